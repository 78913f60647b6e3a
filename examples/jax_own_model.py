"""A JAX user's own model and loop joining a diloco run (`pip install 'diloco[jax]'`).

    diloco syncer --set learners.count=2 &         # a syncer for two learners
    python examples/jax_own_model.py 127.0.0.1:7070 & python examples/jax_own_model.py 127.0.0.1:7070

The model is a two-layer MLP language model in Flax (nn.Dense keeps its kernel as (in, out)); the name
map gives each pytree path the name it has in Θ, and says which tensors Θ keeps transposed. Every
learner of the run must bring the same map: Θ's names and shapes are checked at join.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.jax.jax_learner import JaxLearner
from diloco.jax.name_map import NameMap

VOCAB, WIDTH, SEQ, BATCH = 64, 64, 32, 8


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
        x = nn.gelu(nn.Dense(4 * WIDTH, name="up")(x))
        return nn.Dense(VOCAB, name="out")(nn.Dense(WIDTH, name="down")(x))


NAMES = NameMap(
    names={"embed.embedding": "embed.weight", "up.kernel": "up.weight", "down.kernel": "down.weight",
           "out.kernel": "out.weight"},
    transposed={"up.weight", "down.weight", "out.weight"},  # torch's (out, in), should a torch peer join
)


def main(syncer: str) -> None:
    model = TinyLM()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    optimizer = optax.adamw(3e-3)

    @jax.jit
    def train_step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    learner = JaxLearner(params, syncer=syncer, names=NAMES, embeddings=["embed.weight"])
    params = learner.params                      # Θ as the run has it (seeded by the first to join)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(learner.id)
    while not learner.should_stop:
        tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)), dtype=jnp.int32)
        params, opt_state, loss = train_step(params, opt_state, tokens)
        params = learner.step(params, tokens=BATCH * SEQ)   # never waits on the network
    report = learner.close()
    print(f"learner {learner.id}: {report['steps']} steps, {report['merges']} merges, loss {float(loss):.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7070")
