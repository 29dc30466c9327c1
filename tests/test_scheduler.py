"""The Scheduler without a model: a fake runner feeds it sampled tokens, failures and aborts (as vLLM tests its own)."""

import itertools

import pytest

from hf_paged.cache import BlockPool, KVCacheManager
from hf_paged.generation import EngineConfig, RequestOutputKind, SamplingParams
from hf_paged.generation.detokenizer import Detokenizer
from hf_paged.generation.sampler import SamplerOutput
from hf_paged.generation.scheduler import Scheduler
from hf_paged.generation.sequence import Request, SequenceStatus
from hf_paged.generation.stopping import Stop, check_stop

EOS = 2


class FakeTokenizer:
    """Token ``t`` reads as ``"<t>"``; token 99 cannot be decoded."""

    all_special_ids = [EOS]

    def decode(self, ids, skip_special_tokens=True):
        if 99 in ids:
            raise UnicodeDecodeError("fake", b"", 0, 1, "token 99 cannot be decoded")
        return "".join(f"<{t}>" for t in ids if not (skip_special_tokens and t == EOS))


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, **options):
    kv = KVCacheManager(BlockPool(num_blocks, block_size), enable_prefix_caching=True)
    config = EngineConfig(block_size=block_size, **{"max_num_batched_tokens": 2048, **options})  # as the engine sets it
    return Scheduler(config, kv, Detokenizer(FakeTokenizer()), max_model_len)


def make_request(name, prompt, **params):
    params.setdefault("max_tokens", 4)
    params.setdefault("temperature", 0)
    return Request(name, None, list(prompt), SamplingParams(**params), seed=0, eos_token_ids=frozenset({EOS}))


def step(scheduler, next_token=lambda seq, k: 10 + seq.num_output_tokens + 100 * k):
    """Schedule, 'run' and update one step; ``next_token(seq, k)`` plays the model and sampler."""
    out = scheduler.schedule()
    sampled = SamplerOutput([next_token(seq, k) for seq, k in out.draws]) if out.draws else None
    return out, scheduler.update(out, sampled)


def run_to_end(scheduler, requests, max_steps=200, **kwargs):
    for request in requests:
        scheduler.add(request)
    for _ in range(max_steps):
        if not scheduler.has_work():
            return
        step(scheduler, **kwargs)
    raise AssertionError("the scheduler did not finish")


def assert_no_leak(scheduler):
    assert not scheduler.has_work()
    assert scheduler.kv_manager.pool.num_used_blocks == 0 and not scheduler.kv_manager.tables


def test_chunked_prefill_computes_a_long_prompt_over_several_steps_and_samples_once():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", range(3, 23), max_tokens=2)
    scheduler.add(request)
    chunks = []
    for _ in range(3):
        out, _ = step(scheduler)
        chunks.append((out.num_tokens, len(out.draws)))
    assert chunks == [([8], 0), ([8], 0), ([4], 1)]
    assert scheduler.num_partial_prefills == 2
    step(scheduler)
    assert request.seqs[0].output_token_ids == [10, 11] and request.is_finished
    assert_no_leak(scheduler)


def test_decodes_come_first_and_the_budget_is_shared():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first, second = make_request("a", range(3, 9)), make_request("b", range(30, 42))
    scheduler.add(first)
    step(scheduler)  # a's prompt
    scheduler.add(second)
    out, _ = step(scheduler)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"] and out.num_tokens == [1, 9]


def test_a_long_prompt_computes_in_chunks_of_the_long_prefill_threshold():
    """vLLM's ``long_prefill_token_threshold``: a short request arriving while a long prompt prefills is computed in
    the same step, and a running decode's step holds a chunk of the cap, not of the whole budget."""
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    long, short, later = make_request("long", range(3, 83)), make_request("short", range(100, 106)), \
        make_request("later", range(90, 96))
    scheduler.add(long)
    out, _ = step(scheduler)
    assert out.num_tokens == [8]
    scheduler.add(short)
    out, _ = step(scheduler)
    assert [(s.request.request_id, n) for s, n in zip(out.seqs, out.num_tokens)] == [("long", 8), ("short", 6)]
    scheduler.add(later)
    out, _ = step(scheduler)  # short decodes, long takes its capped chunk, later's whole prompt joins
    assert [(s.request.request_id, n) for s, n in zip(out.seqs, out.num_tokens)] == [("short", 1), ("long", 8),
                                                                                    ("later", 6)]
    run_to_end(scheduler, [])
    assert long.seqs[0].output_token_ids == [10, 11, 12, 13]
    assert_no_leak(scheduler)


def test_no_long_prefill_threshold_lets_a_running_prompt_take_the_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=0)
    scheduler.add(make_request("long", range(3, 83)))
    step(scheduler)
    scheduler.add(make_request("short", range(3, 9)))
    out, _ = step(scheduler)
    assert out.num_tokens == [32]


def tokens_computed(requests, **options) -> tuple[int, int, list[list[int]]]:
    """Run ``requests`` to the end on a scheduler with ``options``: the tokens computed, the preemptions, each
    request's output, the prefix-cache hits and the cached tokens the requests report."""
    scheduler, computed = make_scheduler(**options), 0
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        out, _ = step(scheduler)
        computed += sum(out.num_tokens)
    assert_no_leak(scheduler)
    return (computed, scheduler.num_preemptions, [r.seqs[0].output_token_ids for r in requests],
            scheduler.kv_manager.prefix_hits, sum(r.num_cached_tokens for r in requests))


def test_prompts_sharing_a_long_prefix_compute_it_once_under_the_cap():
    """Admitted together, each prompt computes a different capped chunk of the shared prefix; in later steps each
    takes the others' blocks instead of computing them again: as many tokens computed as with no cap, and as many
    counted as prefix-cache hits and as the requests' cached tokens."""
    prefix = list(range(3, 43))  # ten blocks of 4

    def requests():
        return [make_request(f"r{i}", prefix + [100 + i] * 3) for i in range(4)]

    capped = tokens_computed(requests(), max_num_batched_tokens=64, long_prefill_token_threshold=8)
    assert capped == tokens_computed(requests(), max_num_batched_tokens=64, long_prefill_token_threshold=0)
    assert capped[0] == 40 + 4 * 3 + 4 * 3  # the prefix once, each one's own tokens, three decode steps each


def test_a_failed_step_gives_back_the_blocks_a_prompt_caught_up_with():
    """A running prompt that took blocks computed earlier in the same step holds blocks never written if the step
    fails: `rollback` returns it to where it was, and the run ends as if the step had not been tried."""
    prefix = list(range(3, 43))
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    requests = [make_request(f"r{i}", prefix + [100 + i] * 3) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    step(scheduler)
    kv, running = scheduler.kv_manager, list(scheduler.running)
    before = [(seq.num_computed_tokens, list(kv.block_table(seq.seq_id))) for seq in running]
    cached = kv.pool.num_cached_blocks
    out = scheduler.schedule()
    # r0 takes the chunks that r1-r3 computed and computes the prefix's last; r1-r3 take that one too, unwritten
    assert [(seq.request.request_id, before, held) for seq, before, held in out.caught_up] == [
        ("r0", 8, 32), ("r1", 16, 40), ("r2", 24, 40), ("r3", 32, 40)]
    assert all(seq.num_computed_tokens == 40 for seq in running[1:])
    scheduler.rollback(out)
    assert [(seq.num_computed_tokens, kv.block_table(seq.seq_id)[: len(table)]) for seq, (_, table)
            in zip(running, before)] == before
    assert kv.pool.num_cached_blocks == cached
    run_to_end(scheduler, [])
    assert [r.seqs[0].output_token_ids for r in requests] == [[10, 11, 12, 13]] * 4
    assert_no_leak(scheduler)


def test_a_prompt_that_caught_up_and_was_preempted_in_the_same_step_is_left_alone_by_rollback():
    """It holds no blocks once preempted (requeued to be recomputed): a failed step has nothing of it to undo."""
    scheduler = make_scheduler(num_blocks=12, max_model_len=48, max_num_batched_tokens=64,
                               long_prefill_token_threshold=8, scheduling_policy="priority")
    prefix = list(range(3, 19))
    forks = make_request("forks", [200] * 6, max_tokens=30, n=8, ignore_eos=True)  # its forks copy blocks as they grow
    z, a = make_request("z", prefix + [100] * 3, max_tokens=2), make_request("a", prefix + [101] * 3, max_tokens=2)
    for request in (forks, z, a):
        scheduler.add(request)
    step(scheduler)
    out = scheduler.schedule()
    assert [(seq.request.request_id, seq.status) for seq, _, _ in out.caught_up] == [("z", SequenceStatus.WAITING)]
    scheduler.rollback(out)
    run_to_end(scheduler, [])
    assert z.seqs[0].output_token_ids == a.seqs[0].output_token_ids == [10, 11]
    assert_no_leak(scheduler)


def test_a_beam_searchs_first_prompt_is_capped_as_any_other():
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    beam = make_request("beam", range(3, 203), max_tokens=4, n=2, use_beam_search=True)
    plain = make_request("plain", range(3, 203), max_tokens=4)
    scheduler.add(beam)
    scheduler.add(plain)
    out = scheduler.schedule()
    assert [(seq.request.request_id, n) for seq, n in zip(out.seqs, out.num_tokens)] == [("beam", 8), ("plain", 8)]


def test_a_capped_prompt_is_admitted_only_when_all_of_it_fits():
    """Under a nearly full cache, a prompt is admitted for its first capped chunk only when its whole prompt fits
    beside what running prompts still need: no preemptions, as with no cap."""
    def requests():
        return [make_request(f"r{i}", [3 + (7 * i + j) % 90 for j in range(40)], max_tokens=8, ignore_eos=True)
                for i in range(4)]

    options = dict(num_blocks=30, max_num_batched_tokens=64, enable_prefix_caching=False)
    capped = tokens_computed(requests(), long_prefill_token_threshold=8, **options)
    assert capped == tokens_computed(requests(), long_prefill_token_threshold=0, **options)
    assert capped[:2] == (4 * (40 + 7), 0)


def test_prefix_blocks_are_shared_within_a_step_and_after_it():
    scheduler = make_scheduler()
    prefix = list(range(3, 19))  # four full blocks of 4
    a, b = make_request("a", prefix + [40]), make_request("b", prefix + [50])
    scheduler.add(a)
    scheduler.add(b)
    out, _ = step(scheduler)
    # b matched the blocks a indexed when it was scheduled: one token left, so it runs first, as decodes do
    assert [(s.request.request_id, n) for s, n in zip(out.seqs, out.num_tokens)] == [("b", 1), ("a", 17)]
    tables = scheduler.kv_manager.block_table
    assert tables(a.seqs[0].seq_id)[:4] == tables(b.seqs[0].seq_id)[:4]
    run_to_end(scheduler, [])
    c = make_request("c", prefix + [60])
    scheduler.add(c)
    out, _ = step(scheduler)
    assert out.num_tokens == [1] and c.num_cached_tokens == 16
    run_to_end(scheduler, [])
    assert_no_leak(scheduler)


def test_running_out_of_blocks_preempts_the_newest_which_is_recomputed():
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    scheduler.kv_manager.enable_prefix_caching = False
    a, b = make_request("a", range(3, 10), max_tokens=12), make_request("b", range(20, 27), max_tokens=12)
    run_to_end(scheduler, [a, b])
    assert scheduler.num_preemptions >= 1
    expected = [10 + i for i in range(12)]
    assert a.seqs[0].output_token_ids == expected and b.seqs[0].output_token_ids == expected
    assert_no_leak(scheduler)


def test_a_preempted_request_keeps_the_prompt_tokens_it_found_cached_when_first_admitted():
    """usage.prompt_tokens_details.cached_tokens: readmitted after a preemption, a request finds its own blocks, its
    output's included, in the prefix cache; what it reports is what it found at its first admission."""
    for fail_readmission in (False, True):  # a step that fails is undone, and admits the request again
        scheduler = make_scheduler(num_blocks=6, block_size=4)
        a, b = make_request("a", range(3, 10), max_tokens=12), make_request("b", range(20, 27), max_tokens=12)
        scheduler.add(a)
        scheduler.add(b)
        failed = 0
        while scheduler.has_work():
            out = scheduler.schedule()
            if fail_readmission and not failed and scheduler.num_preemptions and out.admitted:
                scheduler.rollback(out)
                failed += 1
                continue
            scheduler.update(out, SamplerOutput([10 + seq.num_output_tokens for seq, _ in out.draws]))
        assert scheduler.num_preemptions >= 1 and failed == fail_readmission
        assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
        assert_no_leak(scheduler)


def test_n_samples_share_the_prompt_then_diverge():
    scheduler = make_scheduler()
    request = make_request("a", range(3, 9), n=3, max_tokens=3)
    scheduler.add(request)
    out, _ = step(scheduler)
    assert [k for _, k in out.draws] == [0, 1, 2] and out.draw_rows == [0, 0, 0]
    assert len(request.seqs) == 3 and len(scheduler.running) == 3
    tables = [scheduler.kv_manager.block_table(s.seq_id) for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]
    run_to_end(scheduler, [])
    assert sorted(s.output_token_ids[0] for s in request.seqs) == [10, 110, 210] and request.is_finished
    assert_no_leak(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_samples_forked_from_a_prompt_are_preempted_after_newer_requests(policy):
    """The samples of an ``n > 1`` request fork after its prompt, when a newer request may already run: they are as
    old as their request, so they run before it and the newer request is preempted first."""
    scheduler = make_scheduler(num_blocks=9, enable_prefix_caching=False, max_num_batched_tokens=8,
                               scheduling_policy=policy)
    older, newer = make_request("older", range(3, 15), n=2, max_tokens=8), make_request("newer", range(20, 24),
                                                                                       max_tokens=8)
    scheduler.add(older)
    scheduler.add(newer)  # starts while the older prompt is in its second chunk
    while len(older.seqs) < 2:
        step(scheduler)
    assert [seq.request.request_id for seq in scheduler.running] == ["older", "older", "newer"]
    while not scheduler.num_preemptions:
        step(scheduler)
    assert newer.seqs[0].status is SequenceStatus.WAITING
    assert all(seq.status is SequenceStatus.RUNNING for seq in older.seqs)
    run_to_end(scheduler, [])
    assert_no_leak(scheduler)


def test_aborting_a_preempted_or_forked_request_frees_everything():
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    a, b = make_request("a", range(3, 10), max_tokens=12), make_request("b", range(20, 27), max_tokens=12)
    scheduler.add(a)
    scheduler.add(b)
    while not scheduler.num_preemptions:
        step(scheduler)
    preempted = next(r for r in (a, b) if r.seqs[0].status is SequenceStatus.WAITING)
    scheduler.abort(preempted)
    assert preempted.seqs[0].finish_reason == "abort" and preempted.is_finished
    forked = make_request("c", range(40, 45), n=2, max_tokens=8)
    scheduler.add(forked)
    while len(forked.seqs) < 2:
        step(scheduler)
    scheduler.abort(forked)
    assert all(s.finish_reason == "abort" for s in forked.seqs)
    unforked = make_request("d", range(50, 55), n=3)
    scheduler.add(unforked)
    scheduler.abort(unforked)  # before its prompt forked: one sequence of three
    assert unforked.is_finished and len(unforked.seqs) == 1
    run_to_end(scheduler, [])
    assert_no_leak(scheduler)


def test_a_failed_step_is_rolled_back_and_recomputed():
    scheduler = make_scheduler()
    prefix = list(range(3, 19))
    a, b = make_request("a", prefix + [40]), make_request("b", prefix + [50])
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.rollback(out)  # the forward raised
    assert [s.status for s in (a.seqs[0], b.seqs[0])] == [SequenceStatus.WAITING] * 2
    assert scheduler.kv_manager.pool.num_cached_blocks == 0 and scheduler.kv_manager.pool.num_used_blocks == 0
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    out, _ = step(scheduler)
    assert [(s.request.request_id, n) for s, n in zip(out.seqs, out.num_tokens)] == [("b", 1), ("a", 17)]
    run_to_end(scheduler, [])
    assert a.seqs[0].output_token_ids == b.seqs[0].output_token_ids == [10, 11, 12, 13]
    assert_no_leak(scheduler)


def test_a_rolled_back_step_counts_nothing():
    """Prefix lookups and partial prefills are counted when a step stands, so a failed one is not counted twice."""
    counts = []
    for fail in (False, True):
        scheduler = make_scheduler(max_num_batched_tokens=8)
        prefix = list(range(3, 19))
        scheduler.add(make_request("a", prefix + [40]))
        run_to_end(scheduler, [])
        scheduler.add(make_request("b", prefix + [50]))
        if fail:
            scheduler.rollback(scheduler.schedule())
        run_to_end(scheduler, [])
        kv = scheduler.kv_manager
        counts.append((kv.prefix_queries, kv.prefix_hits, scheduler.num_partial_prefills))
    assert counts[0] == counts[1] == (17 + 17, 16, 2)


def test_a_token_that_cannot_be_appended_fails_only_its_request():
    scheduler = make_scheduler()
    good, bad = make_request("good", range(3, 9)), make_request("bad", range(20, 26))
    run_to_end(scheduler, [good, bad], next_token=lambda seq, k: 99 if seq.request is bad else 10)
    assert bad.error is not None and "cannot be decoded" in bad.error and bad.seqs[0].finish_reason == "abort"
    assert good.error is None and good.seqs[0].output_token_ids == [10] * 4
    assert_no_leak(scheduler)


def test_delta_outputs_carry_only_the_step_and_hold_back_a_possible_stop_string():
    scheduler = make_scheduler()
    request = make_request("a", range(3, 9), max_tokens=40, output_kind=RequestOutputKind.DELTA, stop=["<15><1"])
    scheduler.add(request)
    deltas = []
    for _ in range(40):
        _, changed = step(scheduler)
        deltas += [o for o in (r.take_output() for r in changed) if o is not None]
        if request.is_finished:
            break
    assert all(len(o.outputs[0].token_ids) <= 1 for o in deltas)
    text = "".join(o.outputs[0].text for o in deltas)
    assert text == "<10><11><12><13><14>" and deltas[-1].outputs[0].stop_reason == "<15><1"
    # Nothing handed back was later cut: every delta's text is a piece of the final text, in order.
    assert all(o.finished == (i == len(deltas) - 1) for i, o in enumerate(deltas))
    merged = deltas[0]
    for later in deltas[1:]:
        merged.add(later)
    assert merged.outputs[0].text == text and merged.outputs[0].token_ids == list(range(10, 17))


@pytest.mark.parametrize(
    "token, produced, total, params, expected",
    [
        (EOS, 1, 10, dict(), Stop("stop", None, len("Paris"))),  # the stop token's text (" end") is cut
        (EOS, 1, 10, dict(min_tokens=2), None),
        (EOS, 3, 10, dict(ignore_eos=True), None),
        (7, 1, 10, dict(stop_token_ids=[7]), Stop("stop", 7, len("Paris"))),
        (7, 1, 10, dict(stop_token_ids=[7], include_stop_str_in_output=True), Stop("stop", 7)),
        (8, 4, 10, dict(max_tokens=4), Stop("length")),
        (8, 1, 32, dict(max_tokens=None), Stop("length")),  # the context is full
        # vLLM's stop_reason: None for the tokenizer's EOS, the token for another EOS (a generation config's)...
        (EOS + 1, 1, 10, dict(), Stop("stop", EOS + 1, len("Paris"))),
        (EOS, 1, 10, dict(stop_token_ids=[EOS]), Stop("stop", None, len("Paris"))),
        (EOS, 1, 10, dict(stop_token_ids=[EOS], ignore_eos=True), Stop("stop", EOS, len("Paris"))),  # ...or ignored
    ],
)
def test_check_stop_is_a_pure_function_of_its_inputs(token, produced, total, params, expected):
    params = SamplingParams(**params)
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else {EOS, EOS + 1})
    assert check_stop(token, produced, total, "Paris end", len(" end"), params, stop_ids, max_model_len=32,
                      eos_token_id=EOS) == expected


def test_stop_strings_end_in_the_new_text_and_the_earliest_wins():
    from hf_paged.generation.stopping import find_stop_string

    assert find_stop_string("xSTOPy", 1, ["STOP"], include_stop=False) is None  # it ended before the new text
    assert find_stop_string("xSTOP", 1, ["STOP"], include_stop=False) == Stop("stop", "STOP", 1)
    assert find_stop_string("abcd", 4, ["cd", "ab"], include_stop=False) == Stop("stop", "ab", 0)
    # As vLLM: the first min_tokens tokens' text is not searched, but a stop string may begin in it.
    params = SamplingParams(min_tokens=3, stop=["<5>", "4><6"])
    assert check_stop(5, 3, 10, "<4><5>", 3, params, frozenset(), 256) is None
    assert check_stop(5, 4, 10, "<4><5>", 3, params, frozenset(), 256) == Stop("stop", "<5>", 3)
    assert check_stop(6, 4, 10, "<4><6>", 3, params, frozenset(), 256) == Stop("stop", "4><6", 1)
    assert check_stop(2, 3, 10, "<4><5>", 3, params, frozenset({2}), 256, EOS) == Stop("stop", None, 3)  # a stop token
    # A stop token that also completes a stop string: its text (and the string in it) goes, unless it is kept.
    params = SamplingParams(stop=["5>"], stop_token_ids=[2])
    assert check_stop(2, 4, 10, "<4><5>", 3, params, frozenset({2}), 256) == Stop("stop", 2, 3)
    kept = params.replace(include_stop_str_in_output=True)
    assert check_stop(2, 4, 10, "<4><5>", 3, kept, frozenset({2}), 256) == Stop("stop", "5>", 6)


def test_a_prompt_waiting_on_a_matched_prefix_gives_its_blocks_back_each_step():
    """B shares A's first two blocks but waits for room while A grows: each step's match takes references on them,
    which must be given back when B is not admitted (else the blocks never free)."""
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", range(20, 32), max_tokens=14)
    b = make_request("b", list(range(20, 28)) + list(range(60, 76)), max_tokens=2)
    scheduler.add(a)
    step(scheduler)
    waited = 0
    scheduler.add(b)
    for _ in range(100):
        if not scheduler.has_work():
            break
        step(scheduler)
        waited += bool(scheduler.waiting)
    assert a.is_finished and b.is_finished and waited > 5
    assert_no_leak(scheduler)
    assert all(count == 0 for count in scheduler.kv_manager.pool.ref_counts)


def test_guesses_leave_a_token_for_every_later_sequence():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    for name in ("a", "b"):
        scheduler.add(make_request(name, range(20, 22), max_tokens=10))
    step(scheduler)
    assert len(scheduler.running) == 2
    first, second = scheduler.running
    out = scheduler.schedule({first.seq_id: [7, 8, 9]})
    assert dict(zip([s.seq_id for s in out.seqs], out.num_tokens)) == {first.seq_id: 3, second.seq_id: 1}
    assert out.spec_token_ids == {first.seq_id: [7, 8]}


def test_guesses_are_dropped_before_a_beam_search_is_preempted_for_room():
    """As for any other sequence: another request's guesses took the last free block, and the search's beams, the
    newest, were preempted for it."""
    scheduler = make_scheduler(num_blocks=5)
    other = make_request("other", range(1, 8), max_tokens=20)
    search = make_request("search", range(21, 28), max_tokens=20, n=2, use_beam_search=True)
    scheduler.add(other)
    scheduler.add(search)
    out = scheduler.schedule()
    scheduler.update(out, SamplerOutput([8, 50], beams=[None, ([50, 51, 52, 53], [-0.1, -0.2, -0.3, -0.4])]))
    assert len(search.seqs) == 2 and scheduler.kv_manager.pool.num_free_blocks == 1
    out = scheduler.schedule({other.seqs[0].seq_id: [9, 10, 11, 12]})
    assert scheduler.num_preemptions == 0 and out.spec_token_ids == {} and out.num_tokens == [1, 1, 1]


def test_max_loras_bounds_the_adapters_running_at_once_and_a_passed_request_keeps_its_place():
    from types import SimpleNamespace

    scheduler = make_scheduler(max_loras=2)
    requests = [make_request(f"r{i}", [5, 6, 7], max_tokens=3) for i in range(5)]
    for request, lora_id in zip(requests, [1, 2, 3, 1, None]):
        request.lora = None if lora_id is None else SimpleNamespace(digest=bytes([lora_id]))
        scheduler.add(request)
    out, _ = step(scheduler)
    assert [seq.request.request_id for seq in out.admitted] == ["r0", "r1", "r3", "r4"]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["r2"]  # adapter 3 waits for a seat
    admitted_at = {}
    for number in range(1, 20):
        if not scheduler.has_work():
            break
        out, _ = step(scheduler)
        admitted_at.update({seq.request.request_id: number for seq in out.admitted})
        assert len({seq.request.adapter for seq in scheduler.running} - {None}) <= 2
    assert admitted_at == {"r2": 3} and all(r.is_finished for r in requests)  # once adapter 1 or 2 has finished
    assert_no_leak(scheduler)


def beam_row(seq):
    """A fake model's beam candidates after ``seq``: ``keep`` distinct tokens, likeliest first, EOS among them after
    some tokens; they depend only on the sequence's last token."""
    keep, last = seq.request.beams.keep, seq.token_ids[-1]
    ids = [(last * 7 + 3 * j) % 50 + 3 for j in range(keep)]
    if last % 4 == 0:
        ids[0] = EOS
    return ids, [-(0.1 + 0.3 * j + (last % 5) * 0.05) for j in range(keep)]


def beam_step_of(scheduler):
    """One step with the fake model of `beam_row`; checks that a search's running beams stay side by side and that a
    step computes all of them that have anything to compute, or none, but for beams that leave a prefix they share
    to a sibling that computes it, and those the step had no room for."""
    out = scheduler.schedule()
    for request in {seq.request.request_id: seq.request for seq in scheduler.running}.values():
        if request.beams is not None:
            positions = [i for i, seq in enumerate(scheduler.running) if seq.request is request]
            assert positions == list(range(positions[0], positions[0] + len(positions)))
            busy = [seq for seq in scheduler.running
                    if seq.request is request and seq.num_computed_tokens < seq.num_tokens]
            computing = [seq for seq in busy if seq in out.seqs]
            full = sum(out.num_tokens) == scheduler.config.max_num_batched_tokens
            assert not computing or full or all(seq in computing or leaves_to_a_sibling(scheduler, seq, computing)
                                                for seq in busy)
    sampled = SamplerOutput([10 + seq.num_output_tokens for seq, _ in out.draws],
                            beams=[beam_row(seq) if seq.request.beams else None for seq, _ in out.draws])
    return out, scheduler.update(out, sampled if out.draws else None)


def leaves_to_a_sibling(scheduler, beam, computing) -> bool:
    """Whether a sibling that computes this step computes a whole block of the prefix that ``beam`` shares with it."""
    size = scheduler.kv_manager.block_size
    for sibling in computing:
        common = next((i for i, (a, b) in enumerate(zip(beam.token_ids[:-1], sibling.token_ids)) if a != b),
                      min(beam.num_tokens - 1, sibling.num_tokens))
        if common - common % size > beam.num_computed_tokens:
            return True
    return False


def run_beams(scheduler, requests, max_steps=300):
    for request in requests:
        scheduler.add(request)
    for _ in range(max_steps):
        if not scheduler.has_work():
            return
        beam_step_of(scheduler)
    raise AssertionError("the scheduler did not finish")


def beams_of(request):
    return [(o.token_ids, o.finish_reason, round(o.cumulative_logprob, 4)) for o in request.take_output().outputs]


def test_beams_share_the_prompt_blocks_and_step_together():
    scheduler = make_scheduler()
    request = make_request("a", range(3, 12), n=3, max_tokens=6, use_beam_search=True)
    scheduler.add(request)
    out, _ = beam_step_of(scheduler)
    assert len(out.draws) == 1 and len(request.seqs) == 3 and len(scheduler.running) == 3  # forked after the prompt
    tables = [scheduler.kv_manager.block_table(seq.seq_id) for seq in request.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the prompt's two full blocks of 4
    out, _ = beam_step_of(scheduler)
    assert sorted(out.num_tokens) == [1, 1, 1] and len(out.block_copies) == 2  # the shared partial block, copied
    run_beams(scheduler, [])
    beams = beams_of(request)
    assert len(beams) == 3 and request.is_finished and request.beams.done
    assert "stop" in {reason for _, reason, _ in beams}  # beams that took EOS are among the best
    scores = [logprob / len(tokens) for tokens, _, logprob in beams]  # length_penalty 1
    assert scores == sorted(scores, reverse=True)
    assert_no_leak(scheduler)


def test_a_beam_search_is_preempted_and_readmitted_whole_with_the_same_beams():
    def search(**options):
        scheduler = make_scheduler(**options)
        beam = make_request("beam", range(3, 14), n=4, max_tokens=10, use_beam_search=True, ignore_eos=True)
        other = make_request("other", range(20, 31), max_tokens=12)
        scheduler.add(other)
        scheduler.add(beam)
        beams_requeued = False
        while scheduler.has_work():
            beam_step_of(scheduler)
            waiting = [seq for seq in beam.seqs if seq.status is SequenceStatus.WAITING]
            assert not waiting or len(waiting) == len(beam.beams.live)  # all the live beams wait, or none
            beams_requeued |= len(waiting) > 1
        assert_no_leak(scheduler)
        return beams_of(beam), other.seqs[0].output_token_ids, beams_requeued

    roomy, other_roomy, _ = search()
    tight, other_tight, beams_requeued = search(num_blocks=16, enable_prefix_caching=False)
    assert beams_requeued and tight == roomy and other_tight == other_roomy
    assert len(roomy) == 4


def started_search(steps, **params):
    """A scheduler whose one request, a beam search of the fake model of `beam_row`, has run ``steps`` steps."""
    scheduler = make_scheduler()
    request = make_request("beam", range(3, 14), use_beam_search=True, ignore_eos=True, **params)
    scheduler.add(request)
    for _ in range(steps):
        beam_step_of(scheduler)
    return scheduler, request


def test_aborting_a_beam_search_frees_every_beam():
    scheduler, request = started_search(3, n=3, max_tokens=20)
    scheduler.abort(request)
    assert request.is_finished and request.take_output().outputs == []
    assert_no_leak(scheduler)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("limits", [{}, {"long_prefill_token_threshold": 4}, {"max_num_batched_tokens": 4}],
                         ids=["whole", "capped", "small-steps"])
def test_beams_recomputed_together_share_their_prompt_blocks(caching, limits):
    """Also in chunks (a long-prefill cap, or steps smaller than the beams): one beam computes what they share, the
    others take its blocks; each computing its own copy, they once took twice the blocks and failed a search that
    fit."""
    scheduler, beam = started_search(6, n=3, max_tokens=10)
    scheduler.config = scheduler.config.replace(**limits)
    scheduler._preempt(scheduler.running[0])
    assert all(seq.status is SequenceStatus.WAITING for seq in beam.beams.live)
    assert scheduler.kv_manager.reset_prefix_cache()  # nothing cached: the beams can only share among themselves
    scheduler.kv_manager.enable_prefix_caching = caching
    out, _ = beam_step_of(scheduler)
    assert len(out.admitted) == 3
    while any(seq.num_tokens - seq.num_computed_tokens > 1 for seq in beam.beams.live):
        beam_step_of(scheduler)
    beams = beam.beams.live
    for first, second in itertools.combinations(beams, 2):  # every whole block of a common prefix, computed once
        common = next(i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids)) if a != b) // 4
        first_table, second_table = (scheduler.kv_manager.block_table(seq.seq_id) for seq in (first, second))
        assert common >= 2 and first_table[:common] == second_table[:common]
    run_beams(scheduler, [])
    assert len(beam.take_output().outputs) == 3
    assert_no_leak(scheduler)


@pytest.mark.parametrize("caching", [True, False])
def test_a_search_that_outgrows_the_kv_cache_fails_by_name_and_the_others_finish(caching):
    scheduler = make_scheduler(num_blocks=12, enable_prefix_caching=caching)
    scheduler.kv_manager.enable_prefix_caching = caching
    beam = make_request("beam", range(3, 14), n=4, max_tokens=40, use_beam_search=True, ignore_eos=True)
    other = make_request("other", range(20, 24), max_tokens=6, ignore_eos=True)
    failed = []
    scheduler.add(beam)
    scheduler.add(other)
    for _ in range(300):
        if not scheduler.has_work():
            break
        out, _ = beam_step_of(scheduler)
        failed += out.failed
    assert failed == [beam] and beam.is_finished and beam.error_param == "n"
    assert "need more KV cache than the engine has (12 blocks of 4 tokens)" in beam.error
    assert other.seqs[0].output_token_ids == [10 + i for i in range(6)]
    assert_no_leak(scheduler)


def test_a_search_alone_that_cannot_grow_fails_at_once_rather_than_preempt_itself():
    scheduler = make_scheduler(num_blocks=16)
    beam = make_request("beam", range(3, 14), n=4, max_tokens=60, use_beam_search=True, ignore_eos=True)
    run_beams(scheduler, [beam])
    assert "need more KV cache" in beam.error and scheduler.num_preemptions == 0
    assert_no_leak(scheduler)


def test_the_priority_policy_admits_by_priority_then_arrival():
    """vLLM's priority scheduling: lower values first, equal ones in arrival order; fcfs keeps arrival order."""
    admitted = {}
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(scheduling_policy=policy, max_num_seqs=1)
        requests = [make_request(name, range(3, 7), max_tokens=2) for name in "abcd"]
        for request, priority in zip(requests, (5, 0, 5, -1)):
            request.priority = priority if policy == "priority" else 0
            scheduler.add(request)
        admitted[policy] = []
        while scheduler.has_work():
            out, _ = step(scheduler)
            admitted[policy] += [seq.request.request_id for seq in out.admitted]
        assert_no_leak(scheduler)
    assert admitted == {"fcfs": list("abcd"), "priority": list("dbac")}


@pytest.mark.parametrize("policy, preempted", [("fcfs", "high"), ("priority", "low")])
def test_the_priority_policy_preempts_the_lowest_priority_first(policy, preempted):
    """Two running requests outgrow the cache: fcfs preempts the newest, the priority policy the one of the highest
    priority value (lowest priority), however old. Both finish with the tokens they get alone."""
    scheduler = make_scheduler(num_blocks=5, scheduling_policy=policy)
    low, high = make_request("low", range(3, 11), max_tokens=8), make_request("high", range(20, 28), max_tokens=8)
    low.priority, high.priority = (9, 0) if policy == "priority" else (0, 0)
    scheduler.add(low)
    step(scheduler)
    scheduler.add(high)
    victims = []
    preempt = scheduler._preempt

    def watched(seq):
        victims.append(seq.request.request_id)
        preempt(seq)

    scheduler._preempt = watched
    run_to_end(scheduler, [])
    assert victims and set(victims) == {preempted}
    assert low.seqs[0].output_token_ids == high.seqs[0].output_token_ids == list(range(10, 18))
    assert_no_leak(scheduler)


def test_a_priority_needs_the_priority_policy(smollm2_path):
    from live_server import tiny_generator

    fcfs = tiny_generator(smollm2_path, num_blocks=16)
    with pytest.raises(ValueError, match="priority 3 needs the priority scheduling policy"):
        fcfs.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=3)
    prioritized = tiny_generator(smollm2_path, num_blocks=16, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be an integer, got 1.5"):
        prioritized.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=1.5)
    outputs = prioritized.run([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False,
                              priority=[1, -2])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]
    for wrong in (False, 0.0, ""):  # falsy, but no integer: refused as run's other prompts' priorities are
        (failed,) = prioritized.run([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=wrong)
        assert f"priority must be an integer, got {wrong!r}" in failed.error
    with pytest.raises(ValueError, match="scheduling_policy is one of fcfs, priority, got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
