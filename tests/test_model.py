"""The model: real Llama 3 shapes, FLOPs, and an init that depends only on (seed, name)."""

import torch

from plait.models.flavors import FLAVORS, model_args
from plait.models.transformer import Transformer, flops_per_token, num_params
from plait.models.rope import apply_rope, rope_table
from plait.models.weights import init_weights


def test_llama3_shapes_build_on_meta_with_published_sizes():
    expected = {"llama3_8b": 8.03e9, "llama3_70b": 70.55e9, "llama3_405b": 405.85e9}
    for flavor, count in expected.items():
        with torch.device("meta"):
            model = Transformer(model_args(flavor, 128256))
        assert abs(num_params(model) - count) / count < 1e-3, flavor
    assert FLAVORS["llama3_8b"].ffn_hidden == 14336 and FLAVORS["llama3_70b"].ffn_hidden == 28672
    with torch.device("meta"):
        small = Transformer(model_args("small", 8192))
    assert 50e6 <= num_params(small) <= 150e6


def test_flops_per_token_matches_6n_plus_attention():
    args = model_args("llama3_8b", 128256)
    n = 8.03e9 - 128256 * 4096  # non-embedding parameters
    assert abs(flops_per_token(args, 8192) - (6 * n + 12 * 32 * 4096 * 8192)) / flops_per_token(args, 8192) < 1e-3


def test_init_is_deterministic_and_keyed_by_name():
    args = model_args("debug", 500)
    a, b = Transformer(args), Transformer(args)
    init_weights(a, seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    init_weights(b, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    init_weights(b, seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    # Different layers draw different values (a shared stream per shape would make them equal).
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))


def test_rope_rotates_pairs_and_keeps_norm():
    table = rope_table(head_dim=8, max_seq_len=16, theta=10000.0)
    x = torch.randn(2, 16, 3, 8)
    y = apply_rope(x, table)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    # Relative: <rope(q, m), rope(k, n)> depends only on m - n.
    q, k = torch.randn(8), torch.randn(8)
    def dot(m, n):
        qm = apply_rope(q.expand(1, 16, 1, 8).clone(), table)[0, m, 0]
        kn = apply_rope(k.expand(1, 16, 1, 8).clone(), table)[0, n, 0]
        return qm @ kn
    torch.testing.assert_close(dot(5, 2), dot(9, 6))


def test_forward_is_causal():
    model = Transformer(model_args("debug", 500))
    init_weights(model, seed=0)
    tokens = torch.randint(0, 500, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 500
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])
