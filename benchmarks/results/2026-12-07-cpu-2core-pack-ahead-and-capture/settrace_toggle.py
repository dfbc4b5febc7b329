"""Per-invoke cost of nnsight's skip pattern (sys.settrace on, a frame's f_trace raising at the body,
settrace restored) with Python work between invokes: 3.11 vs 3.12."""
import sys, time

# 200 distinct small functions: the Python code an invoke runs between two skips (nnsight, vLLM's SamplingParams...)
ns = {}
src = "\n".join(f"def f{i}(x):\n    y = x + {i}\n    return y * 2 if y % 3 else y - 1\n" for i in range(200))
exec(src, ns)
FUNCS = [ns[f"f{i}"] for i in range(200)]

class Exit(Exception):
    pass

def work():
    total = 0
    for f in FUNCS:
        total += f(total % 7)
    return total

def skip_armed():
    displaced = sys.gettrace()
    frame = sys._getframe(1)
    def skip(frame, event, arg):
        raise Exit()
    sys.settrace(lambda *a, **k: None)
    frame.f_trace = skip

def invoke(trace: bool):
    try:
        if trace:
            skip_armed()
        x = 1  # the "body" line: the hook raises here
        x += 1
    except Exit:
        pass
    finally:
        if trace:
            sys.settrace(None)
    work()

def run(n, trace):
    t = time.perf_counter()
    for _ in range(n):
        invoke(trace)
    return (time.perf_counter() - t) / n * 1e6

for _ in range(2):
    plain = min(run(256, False) for _ in range(5))
    traced = min(run(256, True) for _ in range(5))
print(f"Python {sys.version.split()[0]}: per invoke {plain:.1f} us without the skip, {traced:.1f} us with it "
      f"(+{traced - plain:.1f} us; 256 invokes +{(traced - plain) * 256 / 1000:.1f} ms)")

if sys.version_info >= (3, 12):
    M = sys.monitoring
    TOOL = 4
    M.use_tool_id(TOOL, "skip")
    _armed = {}
    def _line(code, lineno):
        target = _armed.get(code)
        if target is not None and lineno >= target:
            del _armed[code]
            M.set_local_events(TOOL, code, 0)
            raise Exit()
    M.register_callback(TOOL, M.events.LINE, _line)

    def invoke_mon():
        try:
            frame = sys._getframe(0)
            _armed[frame.f_code] = frame.f_lineno + 2
            M.set_local_events(TOOL, frame.f_code, M.events.LINE)
            x = 1  # the body
            x += 1
        except Exit:
            pass
        work()

    def run_mon(n):
        t = time.perf_counter()
        for _ in range(n):
            invoke_mon()
        return (time.perf_counter() - t) / n * 1e6
    mon = min(run_mon(256) for _ in range(5))
    print(f"  with sys.monitoring local LINE events instead: {mon:.1f} us per invoke (+{mon - plain:.1f} us)")
