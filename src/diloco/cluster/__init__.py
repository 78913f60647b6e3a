"""`diloco run --ray`: the same run on a Ray cluster, with learners placed wherever capacity appears.

`network/homes.py` decides (which node, which learner id) without touching Ray; `host.py` is the Ray actor
that keeps one of our processes on its node; `launcher.py` drives them. Only `host.py` and
`launcher.py` import Ray, and nothing outside this package imports them: `import diloco` never does.
"""
