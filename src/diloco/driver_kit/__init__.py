"""What both drivers decide the same way: each learner's plan and last step, when Θ is evaluated, and
the run's summary. The simulator (`diloco.sim`) and the real driver (`launch/`, `client/`) import it;
it imports neither."""
