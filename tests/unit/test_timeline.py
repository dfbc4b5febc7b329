"""The run timeline's summary (pure logic; the events come from the engine actor and a rank)."""
from nnsight_ray._internal.observe.timeline import ADDED, ATTACHED, COLLECT, ENDED, FETCH, GC, HANDED, MERGED, RENDER, SENT, STEP, SUBMIT, Timeline, summarize


def test_summary_reads_the_events_of_the_run_only():
    engine = [(0.5, SUBMIT, 9, 0.5), (10.0, SUBMIT, 4, 10.0), (10.001, ADDED, 1, 10.002), (10.003, ADDED, 1, 10.004),
              (10.2, ENDED, 1, 10.2), (10.3, ENDED, 1, 10.3)]
    steps = [(9.0, STEP, 99, 9.1), (10.01, STEP, 256, 10.02), (10.05, STEP, 1024, 10.10), (10.11, STEP, 1024, 10.16)]
    line = summarize(10.0, 10.4, engine, steps)
    assert line.startswith("submit +0; added 2 by +2..+4; 3 steps +10..+160, in steps 110, between 40")
    assert "median 20.0, max 30.0" in line and "1 under half full; tokens [256, 1024, 1024]" in line
    assert line.endswith("2 ended by +300; result +400")


def test_summary_says_when_the_merge_fetched_merged_and_handed_back():
    merges = [(10.2, FETCH, 64, 10.25), (10.25, MERGED, 64, 10.26), (10.3, HANDED, 64, 10.3), (9.0, FETCH, 1, 9.1)]
    line = summarize(10.0, 10.4, [], [], merges)
    assert line == "merge fetched 64 in 1, the last +200..+250; merged by +260; handed +300; result +400"


def test_summary_puts_the_callers_attach_and_send_before_the_engines_submit():
    caller = [(9.0, SENT, 1, 9.0), (10.002, ATTACHED, 256, 10.030), (10.031, SENT, 256, 10.033), (10.04, GC, 2, 10.09)]
    line = summarize(10.0, 10.4, [(10.072, SUBMIT, 256, 10.072)], [], caller=caller)
    assert line == "attached 256 +2..+30; sent +31..+33; submit +72; result +400; caller gc 1x 50 (longest 50, generation 2)"


def test_summary_of_a_run_with_no_events():
    assert summarize(1.0, 1.25, [], []) == "result +250"


def test_timeline_keeps_its_last_events_only():
    timeline = Timeline(size=3)
    for value in range(5):
        timeline.mark(STEP, value)
    assert [e[2] for e in timeline.since(0.0)] == [2, 3, 4]
    began, = [e[0] for e in timeline.since(0.0)][-1:]
    assert [e[2] for e in timeline.since(began)] == [4]


def test_summary_says_what_rendered_and_which_collections_paused_whom():
    engine = [(10.0, SUBMIT, 4, 10.0), (10.0, RENDER, 4, 10.05), (10.06, GC, 2, 10.09), (10.21, COLLECT, 4, 10.25)]
    steps = [(10.1, STEP, 64, 10.2), (10.12, GC, 0, 10.125)]
    line = summarize(10.0, 10.3, engine, steps)
    assert "rendered 4 in 1 +0..+50 (longest 50)" in line
    assert line.endswith("collected 4 in 1 stash calls, the last +210..+250; result +300; "
                         "engine gc 1x 30 (longest 30, generation 2); rank gc 1x 5 (longest 5, generation 0)")


def test_collections_are_recorded_with_their_generation_once_per_process(monkeypatch):
    import gc
    import time

    from nnsight_ray._internal.observe import timeline as module

    monkeypatch.setattr(module, "GC_MIN_S", 0.0)  # record every one
    before = len(gc.callbacks)
    module.watch_gc()
    module.watch_gc()
    assert len(gc.callbacks) <= before + 1
    began = time.monotonic()
    gc.collect(2)
    events = module.with_gc([(began, STEP, 7, began)], began)
    assert [e[2] for e in events if e[1] == GC][-1:] == [2] and events[0][1] == STEP
