"""The MoE routing math (megalite/expert_parallel/router.py) against explicit references and
Hugging Face's Mixtral; gradients by gradcheck; the losses summed over shards equal the whole;
GShard's capacity drop order on a hand-worked example; zero tokens."""

import pytest
import torch

from megalite.expert_parallel.router import (
    balancing_loss,
    capacity,
    drop_over_capacity,
    expert_counts,
    sigmoid_top_k,
    softmax_top_k,
    update_bias,
    z_loss,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def _logits(tokens: int, num_experts: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, num_experts, generator=generator, dtype=dtype)


def _best_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """The reference choice: the k largest of each row, by a full descending sort."""
    return values.argsort(dim=-1, descending=True, stable=True)[:, :k]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_softmax_top_k_against_the_formula(k):
    logits = _logits(16, 6).to(torch.bfloat16)
    routing = softmax_top_k(logits, k)
    probs = torch.softmax(logits.float(), dim=-1)
    experts = _best_first(probs, k)
    chosen = probs.gather(-1, experts)
    assert routing.probs.dtype == routing.gates.dtype == torch.float32
    assert routing.experts.dtype == torch.int64
    torch.testing.assert_close(routing.probs, probs)
    assert torch.equal(routing.experts, experts)
    torch.testing.assert_close(routing.gates, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(16))


def test_softmax_top_1_gate_is_one():
    assert torch.equal(softmax_top_k(_logits(16, 6), 1).gates, torch.ones(16, 1))


def test_softmax_top_k_is_mixtrals_routing():
    """The same experts and bit-identical gates as transformers' MixtralSparseMoeBlock router."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    torch.nn.init.normal_(block.gate.weight)
    with torch.no_grad():
        logits, gates, experts = block.gate(torch.randn(32, 16))
        routing = softmax_top_k(logits, 2)
    assert torch.equal(routing.experts, experts)
    assert torch.equal(routing.gates, gates)


def test_sigmoid_top_k_against_the_formula():
    logits, bias = _logits(16, 8), 0.5 * _logits(1, 8, seed=1)[0]
    routing = sigmoid_top_k(logits, 3, bias, scale=2.5)
    scores = torch.sigmoid(logits)
    experts = _best_first(scores + bias, 3)
    chosen = scores.gather(-1, experts)
    torch.testing.assert_close(routing.probs, scores)
    assert torch.equal(routing.experts, experts)
    torch.testing.assert_close(routing.gates, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    unbiased = sigmoid_top_k(logits, 3, None)
    assert torch.equal(unbiased.experts, _best_first(scores, 3))


def test_sigmoid_bias_moves_the_choice_not_the_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scores = torch.sigmoid(logits)[0]
    assert sigmoid_top_k(logits, 2, None).experts.tolist() == [[0, 1]]
    # A bias lifts expert 3 over expert 1; the gates are the unbiased scores of the new choice.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])
    routing = sigmoid_top_k(logits, 2, bias)
    assert routing.experts.tolist() == [[3, 0]]
    chosen = scores[[3, 0]]
    torch.testing.assert_close(routing.gates[0], chosen / chosen.sum())
    # A bias that leaves the chosen set alone leaves the gates bit-identical (in the new order).
    reorder = sigmoid_top_k(logits, 2, torch.tensor([0.0, 0.5, 0.0, 0.0]))
    assert reorder.experts.tolist() == [[1, 0]]
    assert torch.equal(reorder.gates.flip(-1), sigmoid_top_k(logits, 2, None).gates)


def test_gradients_by_gradcheck():
    logits = _logits(5, 4, dtype=torch.float64).requires_grad_()
    bias = torch.tensor([0.0, 0.3, -0.2, 0.1])
    routing = softmax_top_k(logits.detach(), 2)  # the choice, held fixed for the loss's check
    torch.autograd.gradcheck(lambda x: softmax_top_k(x, 2).gates, (logits,))
    torch.autograd.gradcheck(lambda x: sigmoid_top_k(x, 2, bias, scale=1.5).gates, (logits,))
    torch.autograd.gradcheck(
        lambda x: balancing_loss(torch.softmax(x, -1), routing.experts, 4, total_tokens=9),
        (logits,),
    )
    torch.autograd.gradcheck(lambda x: z_loss(x, total_tokens=9), (logits,))


def test_balancing_loss_against_the_formula_and_mixtral():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts, k, tokens = 6, 2, 20
    logits = _logits(tokens, num_experts)
    routing = softmax_top_k(logits, k)
    loss = balancing_loss(routing.probs, routing.experts, num_experts, tokens)
    routed = torch.nn.functional.one_hot(routing.experts, num_experts).sum(dim=(0, 1))
    f = routed.float() / (tokens * k)
    p = routing.probs.mean(dim=0)
    torch.testing.assert_close(loss, num_experts * (f * p).sum())
    # Hugging Face's f counts a token's k choices as k tokens, so its loss is k times this one.
    mixtral = load_balancing_loss_func((logits,), num_experts, k)
    torch.testing.assert_close(k * loss, mixtral)


def test_balancing_loss_is_one_when_uniform():
    num_experts, k, tokens = 4, 2, 8
    experts = torch.arange(tokens * k).remainder(num_experts).view(tokens, k)
    probs = torch.full((tokens, num_experts), 1 / num_experts)
    assert expert_counts(experts, num_experts).tolist() == [4, 4, 4, 4]
    torch.testing.assert_close(
        balancing_loss(probs, experts, num_experts, tokens), torch.tensor(1.0)
    )


def test_losses_summed_over_shards_equal_the_whole():
    """Shards of 5, 0 and 7 tokens: with the set's counts and token total, the shards' losses
    and their gradients add up to the whole set's."""
    num_experts, k, tokens = 5, 2, 12
    logits = _logits(tokens, num_experts).requires_grad_()
    routing = softmax_top_k(logits, k)
    whole = balancing_loss(routing.probs, routing.experts, num_experts, tokens)
    whole_z = z_loss(logits, tokens)
    whole_grad = torch.autograd.grad(whole + whole_z, logits)[0]

    shards = [logits.detach()[:5], logits.detach()[5:5], logits.detach()[5:]]
    shards = [shard.clone().requires_grad_() for shard in shards]
    routings = [softmax_top_k(shard, k) for shard in shards]
    counts = sum(expert_counts(r.experts, num_experts) for r in routings)
    assert torch.equal(counts, expert_counts(routing.experts, num_experts))
    parts = [balancing_loss(r.probs, r.experts, num_experts, tokens, counts) for r in routings]
    z_parts = [z_loss(shard, tokens) for shard in shards]
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(sum(z_parts), whole_z)
    grads = torch.autograd.grad(sum(parts) + sum(z_parts), shards)
    torch.testing.assert_close(torch.cat(grads), whole_grad)


def test_z_loss_against_the_formula():
    logits = _logits(10, 4).to(torch.bfloat16)
    expected = (torch.logsumexp(logits.float(), -1) ** 2).mean()
    torch.testing.assert_close(z_loss(logits, 10), expected)
    assert z_loss(logits, 10).dtype == torch.float32


def test_expert_counts_match_bincount():
    experts = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(0))
    counts = expert_counts(experts, 9)  # experts 7 and 8 take nothing
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(experts.flatten(), minlength=9))


def test_update_bias_moves_towards_balance():
    bias = torch.tensor([0.5, 0.5, 0.5, 0.5])
    storage = bias.data_ptr()
    update_bias(bias, torch.tensor([1, 5, 3, 3]), rate=0.25)  # mean 3
    assert bias.tolist() == [0.75, 0.25, 0.5, 0.5]
    assert bias.data_ptr() == storage
    update_bias(bias, torch.tensor([4, 4, 4, 4]), rate=0.25)  # balanced: no move
    assert bias.tolist() == [0.75, 0.25, 0.5, 0.5]


def test_capacity():
    assert capacity(tokens=8, num_experts=4, k=2, factor=1.0) == 4
    assert capacity(tokens=8, num_experts=4, k=2, factor=1.25) == 5
    assert capacity(tokens=7, num_experts=4, k=2, factor=1.0) == 4  # 3.5 rounds up
    assert capacity(tokens=10, num_experts=1, k=1, factor=1.1) == 11  # not 11.000000000000002
    assert capacity(tokens=0, num_experts=4, k=2, factor=1.0) == 0


def test_drop_over_capacity_hand_worked():
    """k=2, capacity 2. In priority order (all first choices, then all second, token order
    within) expert 0 gets t1c0, t2c0, t0c1, t3c1 and keeps the first two; token order would
    have kept t0c1 over t2c0. Experts 1 (t0c0, t2c1) and 2 (t3c0, t1c1) keep theirs."""
    experts = torch.tensor([[1, 0], [0, 2], [0, 1], [2, 0]])
    keep, dropped = drop_over_capacity(experts, capacity=2)
    assert keep.tolist() == [[True, False], [True, True], [True, True], [True, False]]
    assert dropped == 2


def test_drop_over_capacity_against_a_loop():
    num_experts, k, tokens = 5, 3, 40
    experts = softmax_top_k(_logits(tokens, num_experts), k).experts
    cap = capacity(tokens, num_experts, k, factor=1.0)
    keep, dropped = drop_over_capacity(experts, cap)
    taken = [0] * num_experts
    expected = torch.zeros(tokens, k, dtype=torch.bool)
    for choice in range(k):
        for token in range(tokens):
            expert = int(experts[token, choice])
            expected[token, choice] = taken[expert] < cap
            taken[expert] += 1
    assert torch.equal(keep, expected)
    counts = expert_counts(experts, num_experts)
    assert dropped == int((counts - cap).clamp(min=0).sum()) == int((~keep).sum()) > 0


def test_no_drops_when_capacity_is_large():
    experts = softmax_top_k(_logits(40, 5), 2).experts
    keep, dropped = drop_over_capacity(experts, capacity(40, 5, 2, 5.0))
    assert bool(keep.all()) and dropped == 0


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    logits = torch.empty(0, 4, device=device, requires_grad=True)
    for routing in (
        softmax_top_k(logits, 2),
        sigmoid_top_k(logits, 2, torch.zeros(4, device=device)),
    ):
        assert routing.experts.shape == routing.gates.shape == (0, 2)
        assert routing.probs.shape == (0, 4)
        counts = expert_counts(routing.experts, 4)
        assert counts.tolist() == [0, 0, 0, 0]
        loss = balancing_loss(routing.probs, routing.experts, 4, total_tokens=0)
        # A shard with no tokens contributes 0 to a set that has some.
        part = balancing_loss(routing.probs, routing.experts, 4, 8, counts + 4)
        assert loss.item() == part.item() == z_loss(logits, 0).item() == 0.0
        (loss + part + z_loss(logits, 8)).backward()
        keep, dropped = drop_over_capacity(routing.experts, capacity=1)
        assert keep.shape == (0, 2) and dropped == 0


@pytest.mark.parametrize("device", DEVICES)
def test_device_results_match_cpu(device):
    """One routing step on `device` gives the CPU's experts, gates, losses and drops."""
    logits, bias = _logits(64, 8).to(torch.bfloat16), 0.1 * _logits(1, 8, seed=1)[0]

    def step(device):
        routing = sigmoid_top_k(logits.to(device), 2, bias.to(device), scale=2.0)
        counts = expert_counts(routing.experts, 8)
        keep, dropped = drop_over_capacity(routing.experts, capacity(64, 8, 2, 1.0))
        updated = bias.to(device).clone()
        update_bias(updated, counts, rate=1e-3)
        loss = balancing_loss(routing.probs, routing.experts, 8, 64) + z_loss(logits.to(device), 64)
        return [routing.experts, routing.gates, counts, keep, dropped, updated, loss]

    for ours, cpu in zip(step(device), step("cpu")):
        if isinstance(ours, torch.Tensor):
            torch.testing.assert_close(ours.cpu(), cpu)
        else:
            assert ours == cpu
