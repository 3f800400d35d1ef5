"""Pipeline schedules: hand-checked lists, the papers' bubble and memory formulas measured by the
simulator, and exhaustive sweeps over layouts for p2p order, coverage and deadlock under NCCL's
blocking sends."""

from __future__ import annotations

import functools

import pytest

from megalite.errors import MegaliteError
from megalite.pipeline.schedule import (
    Action,
    Op,
    ScheduleError,
    build_schedule,
    compute_order,
    interleaved_warmup,
    p2p_batches,
    peer_of,
    stage_owner,
    v_shaped,
    virtual_stage,
)
from megalite.pipeline.simulate import SimResult, simulate, validate


def schedules(kind: str, pp: int, m: int, vpp: int = 1, group: int | None = None):
    return [build_schedule(kind, pp, rank, m, vpp, group) for rank in range(pp)]


def run(
    kind: str,
    pp: int,
    m: int,
    vpp: int = 1,
    group: int | None = None,
    f=1.0,
    b=2.0,
    p2p=0.0,
    w=None,
) -> SimResult:
    """Build, validate and simulate every rank's list (cached: several tests read one run).
    `b` is the whole backward; `w` its weight gradients' part (default half)."""
    return _run(kind, pp, m, vpp, group, f, b, p2p, w)


@functools.cache
def _run(kind: str, pp: int, m: int, vpp: int, group: int | None, f, b, p2p, w) -> SimResult:
    lists = schedules(kind, pp, m, vpp, group)
    validate(lists, pp, vpp, m, v_shaped(kind))
    return simulate(lists, pp, vpp, f, b, p2p, weight_cost=w, v_shape=v_shaped(kind))


FORWARD_OPS = (Op.FORWARD, Op.RECV_FORWARD, Op.SEND_FORWARD)


def forward_only(lists: list[list[Action]]) -> list[list[Action]]:
    """What evaluation runs: the forward actions of each rank's list (`Run.schedule`)."""
    return [[a for a in actions if a.op in FORWARD_OPS] for actions in lists]


def code(action: Action) -> str:
    """Short form: op code and micro-batch, plus `.chunk` when the chunk is not 0."""
    return f"{action.op.value}{action.microbatch}" + (f".{action.chunk}" if action.chunk else "")


def codes(actions: list[Action]) -> list[str]:
    return [code(a) for a in actions]


def batched(actions: list[Action]) -> str:
    """The list as the executor runs it, each p2p batch in brackets."""
    return " ".join(
        code(step) if isinstance(step, Action) else f"[{' '.join(codes(step))}]"
        for step in p2p_batches(actions)
    )


def group_sizes(pp: int, vpp: int, m: int) -> list[int | None]:
    """Interleaved group sizes N to try. With pp = 2, where activations and gradients share one
    rank pair, every accepted N (pp <= N <= m, m % N == 0 or >= pp); otherwise the default (pp),
    one group of all m, and the smallest N that leaves an accepted partial last group."""
    if vpp == 1:
        return [None]
    accepted = [n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp]
    if pp == 2:
        return accepted
    partial = [n for n in accepted if m % n][:1]
    return sorted({n for n in (pp, m) if n in accepted} | set(partial))


def test_1f1b_pp2_m3_by_hand():
    # Rank 0 warms up with one forward; rank 1 (last stage) starts 1F1B at once. Each batch
    # holds the sends of the compute before it and the receives whose message is sent by then:
    # rank 0 sends an activation and receives a gradient together (Megatron's
    # send_forward_recv_backward), and rank 1 takes mb 1's activation while it works on mb 0.
    assert (
        batched(build_schedule("1f1b", 2, 0, 3))
        == "F0 [SF0] F1 [SF1 RB0] B0 F2 [SF2 RB1] B1 [RB2] B2"
    )
    assert (
        batched(build_schedule("1f1b", 2, 1, 3))
        == "[RF0] F0 [RF1] B0 [SB0] F1 B1 [SB1 RF2] F2 B2 [SB2]"
    )


def test_p2p_batches_group_the_actions_between_two_computes():
    actions = [Action(Op.RECV_FORWARD, 0, 0), Action(Op.FORWARD, 0, 0)]
    actions += [Action(Op.SEND_FORWARD, 0, 0), Action(Op.RECV_BACKWARD, 0, 0)]
    actions += [Action(Op.BACKWARD, 0, 0), Action(Op.SEND_BACKWARD, 0, 0)]
    assert p2p_batches(actions) == [
        (actions[0],),
        actions[1],
        (actions[2], actions[3]),
        actions[4],
        (actions[5],),
    ]


def test_interleaved_pp2_forward_order_by_hand():
    # Groups of N=2: chunk 0 of mbs 0,1, then chunk 1 of mbs 0,1, then the next group.
    # Rank 0 warms up with min((2-0-1)*2 + (2-1)*2, 8) = 4 forwards.
    forwards = [a for a in build_schedule("interleaved", 2, 0, 4, vpp=2) if a.op.is_compute]
    assert codes(forwards) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3".split()
    )


def test_pp2_receives_follow_the_send_order():
    """With pp=2 both directions share one rank pair. With groups larger than pp, rank 0 sends
    the gradient for (mb 0, chunk 0) before the activation of (mb 3, chunk 1), so rank 1 must
    receive it first, although it needs it later."""
    rank1 = build_schedule("interleaved", 2, 1, 4, vpp=2, group_size=4)
    gradient = rank1.index(Action(Op.RECV_BACKWARD, 0, 0))
    activation = rank1.index(Action(Op.RECV_FORWARD, 3, 1))
    assert gradient < activation < rank1.index(Action(Op.BACKWARD, 0, 0))
    simulate(schedules("interleaved", 2, 4, 2, 4), 2, 2)


def test_stages_and_peers():
    assert virtual_stage(pp_rank=1, chunk=2, pp_size=4) == 9
    # The last rank's chunk 0 feeds rank 0's chunk 1, and gets its gradient back from it.
    assert peer_of(Action(Op.SEND_FORWARD, 0, 0), 3, 4, 2) == (0, 1)
    assert peer_of(Action(Op.RECV_BACKWARD, 0, 0), 3, 4, 2) == (0, 1)
    assert peer_of(Action(Op.RECV_FORWARD, 0, 1), 0, 4, 2) == (3, 0)
    assert peer_of(Action(Op.SEND_BACKWARD, 5, 1), 2, 4, 2) == (1, 1)
    with pytest.raises(ScheduleError, match="no peer"):
        peer_of(Action(Op.RECV_FORWARD, 0, 0), 0, 4, 2)  # the first virtual stage
    with pytest.raises(ScheduleError, match="no peer"):
        peer_of(Action(Op.SEND_FORWARD, 0, 1), 3, 4, 2)  # the last virtual stage
    with pytest.raises(ScheduleError, match="compute"):
        peer_of(Action(Op.FORWARD, 0, 0), 1, 4, 2)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("m", range(1, 11))
def test_interleaved_with_one_chunk_is_1f1b(pp: int, m: int):
    assert schedules("interleaved", pp, m) == schedules("1f1b", pp, m)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("costs", [(1.0, 1.0), (1.0, 2.0)])
def test_bubble_1f1b_and_gpipe(kind: str, pp: int, costs: tuple[float, float]):
    """Every rank idles (P - 1)(f + b): the bubble is (P - 1) / m of the compute time."""
    f, b = costs
    for m in range(1, 13):
        result = run(kind, pp, m, f=f, b=b)
        assert result.makespan == pytest.approx((m + pp - 1) * (f + b))
        assert result.idle == pytest.approx([(pp - 1) * (f + b)] * pp)
        assert result.bubble_ratio == pytest.approx((pp - 1) / m)
        assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vpp", [2, 3])
@pytest.mark.parametrize("costs", [(1.0, 1.0), (1.0, 2.0)])
def test_bubble_interleaved(pp: int, vpp: int, costs: tuple[float, float]):
    """Costs are per chunk, so a rank computes vpp * m * (f + b) and idles (P - 1)(f + b):
    the bubble is (P - 1) / (vpp * m) for every group size tried, partial last groups included."""
    f, b = costs
    for m in range(pp, 13):
        for group in group_sizes(pp, vpp, m):
            result = run("interleaved", pp, m, vpp, group, f, b)
            assert result.idle == pytest.approx([(pp - 1) * (f + b)] * pp), (m, group)
            assert result.bubble_ratio == pytest.approx((pp - 1) / (vpp * m))
            assert result.bubble_fraction == pytest.approx((pp - 1) / (vpp * m + pp - 1))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_peak_activations_1f1b_and_gpipe(pp: int):
    for m in range(1, 10):
        peak_1f1b = run("1f1b", pp, m).peak_in_flight
        assert peak_1f1b == [min(pp - rank, m) for rank in range(pp)]
        assert run("gpipe", pp, m).peak_in_flight == [m] * pp


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vpp", [2, 3])
def test_peak_activations_interleaved(pp: int, vpp: int):
    """Rank 0 holds its warmup forwards plus one: min(2(P-1) + (V-1)N + 1, mV) chunks. With
    N = P and m > P that is P + (P-1)/V micro-batches' worth, the (1 + (P-1)/(P V)) * P of
    docs/architecture.md;
    with m = P every forward is in flight at once: P micro-batches' worth."""
    for m in range(pp, 13):
        for group in group_sizes(pp, vpp, m):
            result = run("interleaved", pp, m, vpp, group)
            warmups = [2 * (pp - rank - 1) + (vpp - 1) * group for rank in range(pp)]
            assert warmups == [interleaved_warmup(pp, rank, vpp, group) for rank in range(pp)]
            expected = [min(warmup + 1, m * vpp) for warmup in warmups]
            assert result.peak_in_flight == expected, (m, group)
    for m in (2 * pp, 3 * pp):
        result = run("interleaved", pp, m, vpp)
        design = (1 + (pp - 1) / (pp * vpp)) * pp
        assert result.peak_in_flight_microbatches[0] == pytest.approx(design)
    first_group_only = run("interleaved", pp, pp, vpp)
    assert first_group_only.peak_in_flight_microbatches[0] == pp


def test_zb_h1_pp2_m3_by_hand():
    # 1F1B's order of F and B; rank 1 (the last stage) keeps one W back, so its last B (which
    # rank 0 waits for) comes before W0, and the held-back W passes fill its cooldown.
    assert (
        batched(build_schedule("zb-h1", 2, 0, 3))
        == "F0 [SF0] F1 [SF1 RB0] B0 W0 [RB1] F2 [SF2] B1 W1 [RB2] B2 W2"
    )
    assert (
        batched(build_schedule("zb-h1", 2, 1, 3))
        == "[RF0] F0 [RF1] B0 [SB0] F1 B1 [SB1] W0 [RF2] F2 B2 [SB2] W1 W2"
    )


def test_zb_v_stages_lie_in_a_v():
    """Rank p holds stages p and 2P - 1 - p: rank 0 the first and the last (embedding and
    head), the last rank the middle two, which hand over without a message."""
    pp = 4
    assert [virtual_stage(r, 0, pp, v_shape=True) for r in range(pp)] == [0, 1, 2, 3]
    assert [virtual_stage(r, 1, pp, v_shape=True) for r in range(pp)] == [7, 6, 5, 4]
    for stage in range(2 * pp):
        assert virtual_stage(*stage_owner(stage, pp, v_shape=True), pp, v_shape=True) == stage
    assert peer_of(Action(Op.SEND_FORWARD, 0, 1), 2, pp, 2, v_shape=True) == (1, 1)
    assert peer_of(Action(Op.RECV_BACKWARD, 0, 0), 2, pp, 2, v_shape=True) == (3, 0)
    with pytest.raises(ScheduleError, match="no peer"):
        peer_of(Action(Op.SEND_FORWARD, 0, 1), 0, pp, 2, v_shape=True)  # the last stage
    last_rank = build_schedule("zb-v", pp, pp - 1, 8, 2)
    assert [a for a in last_rank if a.op.is_send and a.chunk == 0] == [
        Action(Op.SEND_BACKWARD, mb, 0) for mb in range(8)
    ]
    assert not [a for a in last_rank if a.op is Op.RECV_FORWARD and a.chunk == 1]


def test_zero_bubble_against_1f1b_and_interleaved_pp4_m8():
    """Qi et al.'s comparison at equal F, B and W (each a chunk's forward): 1F1B idles
    (P-1)(F+B+W) per rank, interleaving divides that by vpp, ZB-H1 idles (P-1)(F+B-W), a
    third of 1F1B's, and ZB-V only the pipeline's fill, P-1 forwards of its half-size chunks:
    a sixth of 1F1B's, the least any schedule can idle with its stages."""
    pp, m = 4, 8
    bubble = {
        kind: run(kind, pp, m, vpp, f=1.0, b=2.0, w=1.0).bubble_ratio
        for kind, vpp in [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]
    }
    assert bubble == pytest.approx(
        {"1f1b": 3 / 8, "interleaved": 3 / 16, "zb-h1": 1 / 8, "zb-v": 1 / 16}
    )
    assert bubble["zb-h1"] == pytest.approx(bubble["1f1b"] / 3)
    assert run("zb-v", pp, m, 2, f=1.0, b=2.0, w=1.0).idle == pytest.approx([pp - 1] * pp)


def held_until_w(actions: list[Action]) -> int:
    """Most micro-batches (per chunk) between their F and their W: what a split backward holds."""
    held = peak = 0
    for action in actions:
        held += (action.op is Op.FORWARD) - (action.op is Op.WEIGHT)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_bubble_and_memory(pp: int):
    """With F = B = W: ZB-H1's bubble is (P-1)/(3m) once m >= P, holding min(P, m) micro-batches
    until their W on every rank (1F1B's first rank's P); ZB-V's (P-1)/(6m) once m >= 2P-1,
    holding 2P chunks of half a stage on every rank: 1F1B's P stages' worth."""
    for m in range(1, 4 * pp + 1):
        h1, v = run("zb-h1", pp, m, w=1.0), run("zb-v", pp, m, 2, w=1.0)
        assert h1.peak_in_flight == run("1f1b", pp, m).peak_in_flight
        assert [held_until_w(a) for a in schedules("zb-h1", pp, m)] == [min(pp, m)] * pp
        if m >= pp:
            assert h1.bubble_ratio == pytest.approx((pp - 1) / (3 * m))
        if m >= 2 * pp - 1:
            assert v.bubble_ratio == pytest.approx((pp - 1) / (6 * m))
            assert [held_until_w(a) for a in schedules("zb-v", pp, m, 2)] == [2 * pp] * pp


@pytest.mark.parametrize(
    "kind,vpp",
    [("gpipe", 1), ("gpipe", 2), ("gpipe", 3), ("1f1b", 1)]
    + [("interleaved", v) for v in (1, 2, 3)],  # 1f1b has one chunk per rank
)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_layout_runs(kind: str, pp: int, vpp: int):
    """Complete, ordered, p2p-matched and deadlock-free, also when messages take time."""
    for m in range(1, 13):
        if kind == "interleaved" and vpp > 1 and m < pp:
            continue
        for group in group_sizes(pp, vpp, m) if kind == "interleaved" else [None]:
            run(kind, pp, m, vpp, group, p2p=0.3)


@pytest.mark.parametrize(
    ("kind", "pp"),
    [
        (kind, pp)
        for pp in (1, 2, 4)
        for kind in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
        if kind != "zb-v" or pp > 1  # zb-v's two chunks need a pipeline
    ],
)
def test_compute_order_is_the_schedule_without_its_messages(kind: str, pp: int):
    for vpp, m in valid_layouts(kind, pp) if pp > 1 else [(1, 1), (1, 5)]:
        for rank in range(pp):
            actions = build_schedule(kind, pp, rank, m, vpp)
            assert list(compute_order(kind, pp, rank, m, vpp)) == [
                a for a in actions if a.op.is_compute
            ]


@pytest.mark.parametrize(
    "kind,pp,vpp",
    [("gpipe", 2, 1), ("gpipe", 2, 3), ("gpipe", 4, 2), ("interleaved", 4, 2), ("zb-v", 4, 2)],
)
def test_forward_only_lists_run(kind: str, pp: int, vpp: int):
    """Evaluation runs GPipe's forwards on the kind's chunk layout, whatever the micro-batch
    count (interleaving's rules are for its training order): they must match by themselves."""
    for m in range(1, 7):
        lists = [build_schedule(kind, pp, r, m, vpp, forward_only=True) for r in range(pp)]
        if kind == "gpipe":
            assert lists == forward_only(schedules("gpipe", pp, m, vpp))
        result = simulate(lists, pp, vpp, v_shape=v_shaped(kind))
        assert result.peak_in_flight == [m * vpp] * pp


CHUNKS = {"1f1b": (1,), "zb-h1": (1,), "zb-v": (2,)}
"""The chunk counts the kinds that do not take any accept."""


def valid_layouts(kind: str, pp: int):
    """(vpp, m) for vpp in 1..4 and m in pp..4pp that `kind` accepts (default group size)."""
    for vpp in CHUNKS.get(kind, (1, 2, 3, 4)):
        for m in range(pp, 4 * pp + 1):
            if kind == "interleaved" and vpp > 1 and m % pp:
                continue  # a last group shorter than pp
            yield vpp, m


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_no_deadlock_under_nccl_semantics(kind: str, pp: int):
    """Every layout, in training and in evaluation (`forward_only`: GPipe's forwards on the
    kind's chunk layout), runs to the end when a send blocks until its receiver's stream
    reaches the matching receive; zero-bubble lists also when B and W cost what they may."""
    layouts = list(valid_layouts(kind, pp))
    assert len(layouts) == {"gpipe": 4}.get(kind, 1) * (3 * pp + 1) + (
        3 * 4 if kind == "interleaved" else 0
    )
    v_shape = v_shaped(kind)
    for vpp, m in layouts:
        lists = schedules(kind, pp, m, vpp)
        validate(lists, pp, vpp, m, v_shape)
        simulate(lists, pp, vpp, v_shape=v_shape)
        if kind in ("zb-h1", "zb-v"):
            simulate(lists, pp, vpp, 1.0, 3.0, 0.2, weight_cost=0.5, v_shape=v_shape)
        evaluation = [build_schedule(kind, pp, r, m, vpp, forward_only=True) for r in range(pp)]
        if kind == "gpipe":
            assert evaluation == forward_only(lists)
        simulate(evaluation, pp, vpp, v_shape=v_shape)


def receive_when_needed(actions: list[Action]) -> list[Action]:
    """The placement the executor used before: each receive right before the compute that
    needs it, batched with what precedes it."""
    receives = [a for a in actions if not a.op.is_compute and not a.op.is_send]
    steps = []
    for action in actions:
        if action.op.is_compute:
            want = Op.RECV_FORWARD if action.op is Op.FORWARD else Op.RECV_BACKWARD
            steps += [r for r in receives if r == Action(want, action.microbatch, action.chunk)]
        if action not in receives:
            steps.append(action)
    return steps


@pytest.mark.parametrize(
    "kind,pp,rank,m,vpp,group,rule",
    [
        ("interleaved", 2, 0, 1, 2, None, "num_microbatches >= pp"),
        ("interleaved", 4, 0, 8, 2, 3, "pp <= microbatch_group_size <= num_microbatches"),
        ("interleaved", 2, 0, 4, 2, 5, "pp <= microbatch_group_size <= num_microbatches"),
        ("interleaved", 2, 0, 3, 2, None, "0 or >= pp"),
        ("interleaved", 4, 0, 6, 3, 4, "0 or >= pp"),
        ("interleaved", 1, 0, 4, 2, None, "virtual stages need a pipeline"),
        ("gpipe", 1, 0, 4, 2, None, "virtual stages need a pipeline"),
        ("1f1b", 2, 0, 4, 2, None, "1f1b runs one chunk per rank"),
        ("zb-h1", 2, 0, 4, 2, None, "zb-h1 runs one chunk per rank"),
        ("zb-v", 2, 0, 4, 1, None, "zb-v runs two chunks per rank"),
        ("zb-v", 2, 0, 4, 3, None, "zb-v runs two chunks per rank"),
        ("pipedream", 2, 0, 4, 1, None, "unknown pipeline schedule"),
        ("1f1b", 2, 0, 0, 1, None, "num_microbatches >= 1"),
        ("interleaved", 2, 0, 4, 0, None, "vpp must be >= 1"),
        ("1f1b", 2, 2, 4, 1, None, "not in 0..pp-1"),
        ("1f1b", 2, 0, 4, 1, 2, "1f1b with vpp=1 runs them in one group: leave it unset"),
        ("interleaved", 2, 0, 4, 1, 0, "interleaved with vpp=1 runs them in one group"),
        ("zb-v", 2, 0, 4, 2, 99, "zb-v with vpp=2 runs them in one group"),
    ],
)
def test_impossible_layouts_name_the_rule(kind, pp, rank, m, vpp, group, rule):
    with pytest.raises(ScheduleError, match=rule) as error:
        build_schedule(kind, pp, rank, m, vpp, group)
    assert isinstance(error.value, ValueError) and isinstance(error.value, MegaliteError)


def test_an_evaluation_list_keeps_the_kinds_chunk_rule():
    """Evaluation runs GPipe's forwards, but on the kind's chunks: a layout the kind refuses is
    refused for evaluation too, not built with sends to a rank that does not exist."""
    with pytest.raises(ScheduleError, match="zb-v runs two chunks per rank"):
        build_schedule("zb-v", 2, 0, 4, 3, forward_only=True)


def test_simulator_reports_p2p_mismatch():
    rank0, rank1 = schedules("1f1b", 2, 2)
    send0, send1 = (
        rank0.index(Action(Op.SEND_FORWARD, 0, 0)),
        rank0.index(Action(Op.SEND_FORWARD, 1, 0)),
    )
    rank0[send0], rank0[send1] = rank0[send1], rank0[send0]
    with pytest.raises(ScheduleError, match="from rank 0 to rank 1, message 0: .* mb 1 .* mb 0"):
        simulate([rank0, rank1], 2, 1)
    with pytest.raises(ScheduleError, match="2 sends but 1 receives"):
        simulate([schedules("1f1b", 2, 2)[0], rank1[:2]], 2, 1)  # RF0 F0 only


def test_simulator_reports_deadlock():
    """Issue 13's example: interleaved pp 2, vpp 2, m 4 with each receive posted right before its
    compute. Rank 0 sends the gradient of (mb 0, chunk 1) in a batch of its own; rank 1 receives
    it only after a batch whose send rank 0 receives only after that one: both streams stop."""
    lists = [receive_when_needed(actions) for actions in schedules("interleaved", 2, 4, 2)]
    with pytest.raises(ScheduleError, match="deadlocks under NCCL semantics") as error:
        simulate(lists, 2, 2)
    assert str(error.value).endswith(
        "rank 0 is stuck at SEND_BACKWARD(mb=0, chunk=1) until rank 1 reaches "
        "RECV_BACKWARD(mb=0, chunk=0); rank 1 is stuck at SEND_BACKWARD(mb=1, chunk=1) until "
        "rank 0 reaches RECV_BACKWARD(mb=1, chunk=1)"
    )


def test_validate_catches_incomplete_or_misordered_lists():
    rank0, rank1 = schedules("1f1b", 2, 3)
    with pytest.raises(ScheduleError, match="BACKWARD\\(mb=2, chunk=0\\) appears 0 times"):
        validate([rank0[:-1], rank1], 2, 1, 3)
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate([rank0 + rank0[:1], rank1], 2, 1, 3)
    b0 = rank1.index(Action(Op.BACKWARD, 0, 0))
    backward_first = [rank1[b0], *rank1[:b0], *rank1[b0 + 1 :]]  # B0 before RF0 F0
    with pytest.raises(ScheduleError, match="comes before"):
        validate([rank0, backward_first], 2, 1, 3)
    with pytest.raises(ScheduleError, match="one per pp rank"):
        validate([rank0], 2, 1, 3)
