import pytest
import torch

from diloco.errors import DilocoError
from diloco.models import GPT, GPTConfig, check_loss


def test_gpt_returns_a_scalar_loss_and_logits():
    model = GPT(GPTConfig(vocab_size=50, context=8, layers=2, width=16, heads=2))
    x = torch.randint(0, 50, (3, 8))
    loss = model(x, x)
    assert loss.dim() == 0 and loss.requires_grad
    assert loss.item() == pytest.approx(torch.log(torch.tensor(50.0)).item(), rel=0.05)  # near-uniform at init
    assert model(x).shape == (3, 8, 50)


def test_gpt_is_causal():
    model = GPT(GPTConfig(vocab_size=20, context=6, layers=1, width=8, heads=2)).eval()
    x = torch.randint(0, 20, (1, 6))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 20
    assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1])


def test_gpt_rejects_sequences_beyond_its_context():
    model = GPT(GPTConfig(vocab_size=20, context=4, layers=1, width=8, heads=2))
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_check_loss_explains_what_is_wrong():
    with pytest.raises(DilocoError, match=r"returned \(2, 3\)"):
        check_loss(torch.zeros(2, 3))
    with pytest.raises(DilocoError, match="not connected"):
        check_loss(torch.tensor(1.0))
    with pytest.raises(DilocoError, match="returned tuple"):
        check_loss((1, 2))
