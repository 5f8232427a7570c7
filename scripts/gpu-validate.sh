#!/usr/bin/env bash
# Validates the shim on a real NVIDIA GPU and appends the results to
# docs/gpu-validation.md. Needs: an NVIDIA driver (libcuda.so.1, nvidia-smi), the
# workspace built in release (cargo build --release), and for the PyTorch part a
# python3 with torch. Run from the repository root: scripts/gpu-validate.sh
#
# 1. two gpuburst notebooks at 60% of the GPU's memory each under kiwi-arbiter
#    (they do not fit together: they must take turns and both verify every byte);
# 2. two PyTorch training loops under `kiwictl run`, same constraint; two PyTorch
#    programs with expandable_segments:True at 60% each (their own VMM memory swaps);
#    two PyTorch notebooks that keep ~10x their live tensors cached, without and with
#    kiwi.enable() (the discard hint): the bytes each swap-out copied;
#    a newcomer's torch.cuda beside an idle notebook holding 95%; which calls load
#    the runtime's kernels lazily (the shim's debug lines: the simulator assumes
#    cuLibraryGetModule then cuModuleGetFunction at a kernel's first launch); two JAX processes
#    with their default preallocation; CuPy managed memory beside a competitor; the
#    NVML under Kiwi (cuprobe nvml, nvidia-smi) beside another tenant; the README's
#    `kiwictl demo --gpu`;
# 3. with two GPUs or more: two gpuburst processes using GPUs 0 and 1 in opposite
#    orders (one turn per GPU, acquired in one order: no deadlock);
# 4. swap throughput and hand-offs from the arbiter's event log;
# 5. the driver's own costs (scripts/gpu-costs.py) and which calls break a stream
#    capture (scripts/gpu-capture-rules.py), both without Kiwi;
# 6. the driver's checkpoint API without Kiwi (scripts/gpu-checkpoint.py: states,
#    refusals, costs) and through the arbiter: a gpuburst notebook that three
#    newcomers' contexts leave no room, which runs once idle newcomers are
#    checkpointed (checkpoint and restore events, with their durations);
# 7. the swap pool (#37): an 18 GiB notebook in a memory cgroup limited to 4 GiB,
#    swapped out by a competitor into a pool whose floor holds it: no OOM kill, every
#    byte verified, and the first swap-out's rate against the 20 GB/s goal.
#
# KIWI_VALIDATE_STEPS=newcomer,lazy,... runs only those steps (burst, torch, expand,
# newcomer, lazy, jax, managed, nvml, demo, graph, hint, multi, checkpoint, pool, costs; all by
# default), for a lent GPU's short time; KIWI_VALIDATE_STEP_TIMEOUT (seconds, 600)
# bounds each program; KIWI_RELEASE_DIR names where the release build is
# (target/release).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${KIWI_RELEASE_DIR:-target/release}
T=${KIWI_VALIDATE_STEP_TIMEOUT:-600}
want() { [ -z "${KIWI_VALIDATE_STEPS:-}" ] || [[ ",${KIWI_VALIDATE_STEPS}," == *",$1,"* ]]; }
# What a step's result says when it does not run: why, or that it was not asked for.
unless() { if want "$1"; then echo "$2"; else echo "not run (KIWI_VALIDATE_STEPS)"; fi; }
for f in kiwi-arbiter kiwictl gpuburst cuprobe kiwi-bench libkiwi.so; do
  [ -e "$R/$f" ] || { echo "missing $R/$f: run cargo build --release first" >&2; exit 1; }
done
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: no NVIDIA driver here" >&2; exit 1; }

GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MEM_MIB=$((TOTAL_MIB * 60 / 100))
WORK=${KIWI_VALIDATE_WORK:-$(mktemp -d)}  # set it to keep the logs
mkdir -p "$WORK"
SOCK="$WORK/sock"
cleanup() { pkill -TERM -f "kiwi-arbiter --socket-dir $SOCK" 2>/dev/null || true; }
trap cleanup EXIT

"$R/kiwi-arbiter" --socket-dir "$SOCK" --tq "${KIWI_TQ:-5}" 2>"$WORK/arbiter.log" &
for _ in $(seq 100); do [ -S "$SOCK/client/arbiter.sock" ] && break; sleep 0.1; done

ra=0; rb=0; burst_result=$(unless burst skipped)
if want burst; then
echo "== gpuburst pair, ${MEM_MIB} MiB each on ${GPU_NAME} (${TOTAL_MIB} MiB)"
t0=$(date +%s.%N)
timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --mem "${MEM_MIB}MiB" --bursts 6 --gpu-ms 2000 --cpu-ms 1000 --name A --seed 1 >"$WORK/a.out" 2>&1 &
A=$!
timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --mem "${MEM_MIB}MiB" --bursts 6 --gpu-ms 2000 --cpu-ms 1000 --name B --seed 2 >"$WORK/b.out" 2>&1 &
B=$!
ra=0; rb=0; wait $A || ra=$?; wait $B || rb=$?
t1=$(date +%s.%N)
burst_result="A exit $ra ($(grep -c 'all bytes as expected' "$WORK/a.out" || true) verified), B exit $rb ($(grep -c 'all bytes as expected' "$WORK/b.out" || true) verified), makespan $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s"
echo "$burst_result"
fi

torch_result=$(unless torch "skipped: no python3 with torch")
if want torch && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== two PyTorch training loops under kiwictl run"
  cat >"$WORK/train.py" <<'PY'
import sys, time, torch
torch.manual_seed(int(sys.argv[1]))
gib = float(sys.argv[2])
dev = "cuda"
# Hold ~gib GiB of parameters and activations, train a few hundred steps.
width = 8192
layers = max(1, int(gib * (1 << 30) / (width * width * 4 * 3)))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(256, width, device=dev)
t = time.time()
for step in range(200):
    loss = model(x).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 50 == 0:
        time.sleep(1.0)  # a notebook's pause: the other one gets the GPU
torch.cuda.synchronize()
print(f"ok loss={loss.item():.4f} {time.time()-t:.1f}s")
PY
  GIB=$(awk "BEGIN{print $MEM_MIB / 1024 / 2}")
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/train.py" 1 "$GIB" >"$WORK/t1.out" 2>&1 & P1=$!
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/train.py" 2 "$GIB" >"$WORK/t2.out" 2>&1 & P2=$!
  r1=0; r2=0; wait $P1 || r1=$?; wait $P2 || r2=$?
  torch_result="loop 1 exit $r1: $(tail -1 "$WORK/t1.out"); loop 2 exit $r2: $(tail -1 "$WORK/t2.out")"
  echo "$torch_result"
fi

expand_result=$(unless expand "skipped: no python3 with torch")
if want expand && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== two PyTorch programs with expandable_segments:True, 60% each (the application's own VMM memory swaps)"
  cat >"$WORK/expand.py" <<'PY'
import sys, time, torch
gib, seed = float(sys.argv[1]), int(sys.argv[2])
n = int(gib * (1 << 30) / 4 / 64)
xs = [torch.full((n,), float(seed * 100 + i), device="cuda") for i in range(64)]
for r in range(6):
    for x in xs:
        x.add_(1)
    torch.cuda.synchronize()
    time.sleep(1.0)  # idle: the other one takes the GPU, these handles are swapped out
bad = [i for i, x in enumerate(xs) if not bool((x == seed * 100 + i + 6).all())]
print("ok" if not bad else f"WRONG tensors {bad}")
PY
  EGIB=$(awk "BEGIN{print $MEM_MIB / 1024}")
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/expand.py" "$EGIB" 1 >"$WORK/e1.out" 2>&1 & E1=$!
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/expand.py" "$EGIB" 2 >"$WORK/e2.out" 2>&1 & E2=$!
  re1=0; re2=0; wait $E1 || re1=$?; wait $E2 || re2=$?
  expand_result="program 1 exit $re1: $(tail -1 "$WORK/e1.out"); program 2 exit $re2: $(tail -1 "$WORK/e2.out")"
  echo "$expand_result"
fi

newcomer_result=$(unless newcomer "skipped: no python3 with torch")
if want newcomer && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== a newcomer starting torch.cuda beside an idle notebook holding 95% of the GPU"
  cat >"$WORK/holder.py" <<'PY'
import sys, time, torch
free, total = torch.cuda.mem_get_info()
x = torch.ones(int(total * 0.95) // 4, device="cuda")  # 95% of the GPU: allowed alone
torch.cuda.synchronize()
print("holding", flush=True)
time.sleep(float(sys.argv[1]))  # idle: its memory is what a newcomer's context needs
print("ok" if x.min().item() == 1 and x.max().item() == 1 else "WRONG")  # no 19 GiB comparison tensor
PY
  cat >"$WORK/newcomer.py" <<'PY'
import time, torch
t = time.time()
torch.cuda.init(); y = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize()
print(f"ok context ready in {time.time() - t:.2f} s" if y.sum().item() == (1 << 20) else "WRONG")
PY
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/holder.py" 20 >"$WORK/n1.out" 2>&1 & N1=$!
  for _ in $(seq 600); do grep -q holding "$WORK/n1.out" 2>/dev/null && break; sleep 0.1; done
  rn2=0; timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/newcomer.py" >"$WORK/n2.out" 2>&1 || rn2=$?
  rn1=0; wait $N1 || rn1=$?
  newcomer_result="newcomer exit $rn2: $(tail -1 "$WORK/n2.out"); holder exit $rn1: $(tail -1 "$WORK/n1.out")"
  echo "$newcomer_result"
fi

lazy_result=$(unless lazy "skipped: no python3 with torch")
if want lazy && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== the runtime's kernels loaded lazily: what the shim measured, by call (KIWI_LOG=debug)"
  cat >"$WORK/lazy.py" <<'PY'
import torch
x = torch.randn(1024, 1024, device="cuda")
y = (x @ x).relu().sum() + x.softmax(0).mean() + torch.sort(x[0]).values[0]
torch.cuda.synchronize()
print("ok", y.item() == y.item(), flush=True)
import time; time.sleep(5)  # the arbiter's NVML reconciliation looks 3 times, 1 s apart
PY
  rl=0; KIWI_LOG=debug CUDA_MODULE_LOADING=LAZY timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/lazy.py" >"$WORK/lazy.out" 2>&1 || rl=$?
  unrep=$("$R/kiwictl" --socket-dir "$SOCK" events 2>/dev/null | grep '"unreported"' | tail -1 | grep -o '"bytes":[0-9]*' | cut -d: -f2)
  lazy_result="exit $rl: $(grep -c "a module's code (loaded lazily) took" "$WORK/lazy.out" || true) lazy loads measured ($(grep -o "a module's code (loaded lazily) took [0-9]* bytes" "$WORK/lazy.out" | awk '{s+=$(NF-1)} END {printf "%d MiB", s/1048576}')), $(grep -c "a library's code took" "$WORK/lazy.out" || true) library modules measured, $(grep -c 'loaded code of' "$WORK/lazy.out" || true) launches that loaded code after waiting; the arbiter counted $(( ${unrep:-0} / 1048576 )) MiB beyond the shim's reports (NVML, event unreported); $(grep -v '^\[kiwi\]' "$WORK/lazy.out" | grep -v '^$' | tail -1)"
  echo "$lazy_result"
fi

jax_result=$(unless jax "skipped: no python3 with jax")
if want jax && python3 -c 'import jax; assert jax.devices("gpu")' 2>/dev/null; then
  echo "== two JAX processes with the default preallocation (75% of what they are told is free)"
  cat >"$WORK/jaxjob.py" <<'PY'
import sys, time, jax, jax.numpy as jnp
x = jnp.full((1 << 26,), float(sys.argv[1]))  # 256 MiB live
for _ in range(6):
    x = x + 1
    x.block_until_ready()
    time.sleep(1.0)
print("ok" if float(x[12345]) == float(sys.argv[1]) + 6 else "WRONG")
PY
  # kiwictl run sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless set: set it to JAX's default.
  XLA_PYTHON_CLIENT_PREALLOCATE=true timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/jaxjob.py" 1 >"$WORK/j1.out" 2>&1 & J1=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=true timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/jaxjob.py" 2 >"$WORK/j2.out" 2>&1 & J2=$!
  rj1=0; rj2=0; wait $J1 || rj1=$?; wait $J2 || rj2=$?
  jax_result="job 1 exit $rj1: $(tail -1 "$WORK/j1.out"); job 2 exit $rj2: $(tail -1 "$WORK/j2.out")"
  echo "$jax_result"
fi

managed_result=$(unless managed "skipped: no python3 with cupy")
if want managed && python3 -c 'import cupy; cupy.cuda.runtime.getDeviceCount()' 2>/dev/null; then
  echo "== CuPy managed memory beside a competitor"
  cat >"$WORK/managed.py" <<'PY'
import sys, time, cupy as cp
cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
n = int(float(sys.argv[1]) * (1 << 30)) // 4
x = cp.full((n,), 3.0, dtype=cp.float32)
bursts = []
for _ in range(6):
    b = time.time(); x += 1; cp.cuda.Stream.null.synchronize(); bursts.append(time.time() - b)
    time.sleep(1.0)
print(("ok" if float(x[12345]) == 9.0 else "WRONG") + f" slowest burst {max(bursts):.2f} s")
PY
  MGIB=$(awk "BEGIN{print $MEM_MIB / 1024 / 2}")
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/managed.py" "$MGIB" >"$WORK/m1.out" 2>&1 & M1=$!
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --mem "${MEM_MIB}MiB" --bursts 4 --gpu-ms 500 --cpu-ms 1000 --name C >"$WORK/m2.out" 2>&1 & M2=$!
  rm1=0; rm2=0; wait $M1 || rm1=$?; wait $M2 || rm2=$?
  managed_result="managed exit $rm1: $(tail -1 "$WORK/m1.out"); competitor exit $rm2 ($(grep -c 'all bytes as expected' "$WORK/m2.out" || true) verified)"
  echo "$managed_result"
fi

nvml_result=$(unless nvml skipped)
if want nvml; then
  echo "== NVML under Kiwi (issue #39): nvidia-smi and cuprobe nvml beside another tenant"
  # The other tenant: a gpuburst notebook at 60% that idles while the checks run, as
  # another user where this is root (uid 65534: its process is not listed here).
  other=""; [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && other="setpriv --reuid=65534 --regid=65534 --clear-groups"
  timeout "$T" $other "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --mem "${MEM_MIB}MiB" --script gpu:500,idle:20000 --name N >"$WORK/n1.out" 2>&1 & N1=$!
  for _ in $(seq 100); do grep -q 'ready:' "$WORK/n1.out" 2>/dev/null && break; sleep 0.2; done
  # In this process: NVML (dlopen + dlsym) against cuMemGetInfo, and the process list.
  timeout 120 "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/cuprobe" nvml --mib 256 >"$WORK/n2.out" 2>&1 || true
  # nvidia-smi under the shim, as a notebook's terminal runs it, and without it.
  timeout 60 "$R/kiwictl" --socket-dir "$SOCK" run -- nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader >"$WORK/n3.out" 2>&1 || true
  timeout 60 "$R/kiwictl" --socket-dir "$SOCK" run -- nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >"$WORK/n4.out" 2>&1 || true
  nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader >"$WORK/n5.out" 2>&1 || true
  wait $N1 || true
  nvml_result="cuprobe nvml: $(grep 'nvml free' "$WORK/n2.out" | head -1); nvidia-smi under Kiwi: $(head -1 "$WORK/n3.out"), apps [$(tr '\n' ';' <"$WORK/n4.out")]; without: $(head -1 "$WORK/n5.out") (the other tenant${other:+, uid 65534,} holds ${MEM_MIB} MiB)"
  echo "$nvml_result"
fi

demo_result=$(unless demo skipped)
if want demo; then
  echo "== kiwictl demo --gpu (the README's demo on this GPU)"
  rd=0; timeout 300 "$R/kiwictl" demo --gpu >"$WORK/demo.out" 2>&1 || rd=$?
  demo_result="exit $rd: $(grep -v '^\s*$' "$WORK/demo.out" | tail -1)"
  echo "$demo_result"
fi

graph_result=$(unless graph "skipped: no python3 with torch")
ipc_result=$(unless graph "skipped: no python3 with torch")
if want graph && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== torch.cuda.graph: capture under Kiwi, replay while a second program competes"
  cat >"$WORK/graph.py" <<'PY'
import sys, time, torch
gib = float(sys.argv[1])
x = torch.zeros(int(gib * (1 << 30) / 4), device="cuda")  # most of this process's share
static = torch.zeros(1 << 20, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):          # warm-up outside the capture, as PyTorch advises
    for _ in range(3):
        static.add_(1)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(2000):           # enough to trip the shim's queue bound mid-capture
        static.add_(1)
for i in range(20):
    g.replay()
    if i % 5 == 0:
        time.sleep(1.0)             # idle: the other program takes its turn, x is swapped
torch.cuda.synchronize()
want = 3 + 2000 * 20              # captured work runs only when replayed
print("ok" if bool((static == want).all()) and x.sum().item() == 0 else f"WRONG {static[0].item()} != {want}")
PY
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/graph.py" "$GIB" >"$WORK/g.out" 2>&1 & G1=$!
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/train.py" 3 "$GIB" >"$WORK/g2.out" 2>&1 & G2=$!
  rg=0; rg2=0; wait $G1 || rg=$?; wait $G2 || rg2=$?
  graph_result="graph exit $rg: $(tail -1 "$WORK/g.out"); competitor exit $rg2: $(tail -1 "$WORK/g2.out")"
  echo "$graph_result"

  echo "== torch.multiprocessing: a CUDA tensor sent to a child process (IPC)"
  cat >"$WORK/ipc.py" <<'PY'
import torch, torch.multiprocessing as mp
def child(q):
    t = q.get()
    print("child sum", t.sum().item())
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q = mp.Queue()
    p = mp.Process(target=child, args=(q,))
    p.start()
    t = torch.ones(1 << 20, device="cuda")
    q.put(t)
    p.join()
    print("ok" if p.exitcode == 0 else f"child exit {p.exitcode}")
PY
  ri=0; timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/ipc.py" >"$WORK/ipc.out" 2>&1 || ri=$?
  # The driver refuses legacy IPC of VMM memory: the shim brokers it (shim/src/ipc.rs).
  ipc_result="exit $ri: $(grep -E '^(child sum|ok|child exit)' "$WORK/ipc.out" | tr '\n' ' ')(expected: child sum 1048576.0 ok)"
  echo "$ipc_result"
fi

hint_result=$(unless hint "skipped: no python3 with torch")
if want hint && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== two PyTorch notebooks reserving ~10x their live tensors: bytes per swap-out, without and with kiwi.enable()"
  cat >"$WORK/cached.py" <<'PY'
import sys, time, torch
mib, hint = int(sys.argv[1]), sys.argv[2] == "1"
if hint:
    import kiwi
    kiwi.enable()
batch = [torch.ones(16 << 20, device="cuda") for _ in range(max(10, mib // 64))]  # 64 MiB each
keep = batch[: len(batch) // 10]
del batch  # the caching allocator keeps the other 90% reserved, free
for step in range(12):
    for t in keep:
        t.add_(1)
    torch.cuda.synchronize()
    time.sleep(1.0)  # idle: the other notebook gets the GPU
ok = all(bool((t == 13).all()) for t in keep)
print(f"ok={ok} reserved {torch.cuda.memory_reserved() >> 20} MiB, live {torch.cuda.memory_allocated() >> 20} MiB",
      kiwi.hint_stats() if hint else "")
PY
  hint_result=""
  for hint in 0 1; do
    PYTHONPATH="$PWD/python" timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/cached.py" "$MEM_MIB" "$hint" >"$WORK/h$hint-1.out" 2>&1 & H1=$!
    PYTHONPATH="$PWD/python" timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- python3 "$WORK/cached.py" "$MEM_MIB" "$hint" >"$WORK/h$hint-2.out" 2>&1 & H2=$!
    rh1=0; rh2=0; wait $H1 || rh1=$?; wait $H2 || rh2=$?
    "$R/kiwictl" --socket-dir "$SOCK" events >"$WORK/events-h$hint.jsonl" || true
    # kiwictl run execs python3: $H1 and $H2 are the pids the shim registered with.
    per=$(python3 - "$WORK/events-h$hint.jsonl" "$H1" "$H2" <<'PY'
import sys, json
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
pids = {int(p) for p in sys.argv[2:]}
ours = {e["client"] for e in ev if e["kind"]["event"] == "register" and e["kind"]["host_pid"] in pids}
out = [e["kind"]["bytes"] for e in ev if e["client"] in ours and e["kind"]["event"] == "swap_out"]
print(f"{len(out)} swap-outs, {sum(out) / max(len(out), 1) / (1 << 20):.0f} MiB each on average")
PY
)
    hint_result+="$([ "$hint" = 1 ] && echo with || echo without) kiwi.enable(): exit $rh1/$rh2, $per, $(tail -1 "$WORK/h$hint-1.out"); "
  done
  echo "$hint_result"
fi

GPUS=$(nvidia-smi -L | grep -c '^GPU ' || true)
multi_result=$(unless multi "skipped: one GPU")
if want multi && [ "$GPUS" -ge 2 ]; then
  echo "== two processes on GPUs 0 and 1 in opposite orders, ${MEM_MIB} MiB on each"
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --device 0,1 --mem "${MEM_MIB}MiB" --bursts 4 --gpu-ms 1000 --cpu-ms 500 --name M1 --seed 3 >"$WORK/m1.out" 2>&1 & M1=$!
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK" run -- "$R/gpuburst" --device 1,0 --mem "${MEM_MIB}MiB" --bursts 4 --gpu-ms 1000 --cpu-ms 500 --name M2 --seed 4 >"$WORK/m2.out" 2>&1 & M2=$!
  rm1=0; rm2=0; wait $M1 || rm1=$?; wait $M2 || rm2=$?
  multi_result="M1 (0,1) exit $rm1, M2 (1,0) exit $rm2, verified: $(grep -c 'all bytes as expected' "$WORK/m1.out" "$WORK/m2.out" | tr '\n' ' ')"
  echo "$multi_result"
fi

ckpt_api=$(unless checkpoint "skipped: no python3 with torch")
ckpt_result=$(unless checkpoint skipped); HOLD_MIB=0
if want checkpoint; then
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== the driver's checkpoint API, no Kiwi"
  timeout 180 python3 scripts/gpu-checkpoint.py 2 >"$WORK/ckpt-api.txt" 2>&1 || true
  cat "$WORK/ckpt-api.txt"; ckpt_api=$(tr '\n' ';' <"$WORK/ckpt-api.txt")
fi
echo "== whole-process eviction through the arbiter"
# The holder leaves room for its own context and about two more (~500 MiB each on a
# data-centre GPU): three newcomers' contexts leave it no room for its working set.
HOLD_MIB=$((TOTAL_MIB - 1600))
SOCK2="$WORK/sock2"
"$R/kiwi-arbiter" --socket-dir "$SOCK2" --tq 2 --checkpoint auto 2>"$WORK/arbiter2.log" &
ARB2=$!
for _ in $(seq 100); do [ -S "$SOCK2/client/arbiter.sock" ] && break; sleep 0.1; done
timeout "$T" "$R/kiwictl" --socket-dir "$SOCK2" run -- "$R/gpuburst" --mem "${HOLD_MIB}MiB" --bursts 5 --gpu-ms 1000 --cpu-ms 1500 --name H --seed 5 >"$WORK/ck-h.out" 2>&1 & CH=$!
sleep 8
CN=()
for i in 1 2 3; do
  timeout "$T" "$R/kiwictl" --socket-dir "$SOCK2" run -- "$R/gpuburst" --mem 64MiB --bursts 5 --gpu-ms 200 --cpu-ms 1500 --name "N$i" --seed $((5 + i)) >"$WORK/ck-n$i.out" 2>&1 & CN+=($!)
done
rh=0; wait $CH || rh=$?
rc_ck="H $rh"
for p in "${CN[@]}"; do rn=0; wait "$p" || rn=$?; rc_ck+=" N $rn"; done
"$R/kiwictl" --socket-dir "$SOCK2" events >"$WORK/events-ckpt.jsonl" || true
kill -TERM "$ARB2" 2>/dev/null || true
ckpt_result="$(grep -m1 'checkpoint:' "$WORK/arbiter2.log" | sed 's/^\[INFO\] //'); exits $rc_ck; verified $(cat "$WORK"/ck-*.out | grep -c 'all bytes as expected' || true); $(python3 - "$WORK/events-ckpt.jsonl" <<'PY'
import sys, json
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
k = lambda e: e["kind"]["event"]
c = [e["kind"] for e in ev if k(e) == "checkpoint"]
r = [e["kind"] for e in ev if k(e) == "restore"]
s = [e["kind"]["reason"] for e in ev if k(e) == "checkpoint_skipped"]
f = lambda xs: ", ".join(f"{x['bytes']>>20} MiB in {x['duration_ns']/1e6:.0f} ms" for x in xs[:6])
print(f"{len(c)} checkpoints ({f(c)}), {len(r)} restores ({f(r)}), skipped: {sorted(set(s)) or 'none'}")
PY
)"
echo "$ckpt_result"
fi

pool_result=$(unless pool skipped)
if want pool; then
echo "== the swap pool (#37): an 18 GiB notebook in a 4 GiB memory cgroup, swapped out by a competitor"
# The competitor wants all but 4 GiB of the GPU, so the notebook swaps out nearly
# all of its 18 GiB. The pool's floor (20 GiB, populated before the notebooks start)
# holds the whole first swap-out ready: its rate is the copy's, not the host's page
# faults. The notebook's memory cgroup (v2, else v1) is limited far below what it
# swaps out: Kiwi's pool, not the tenant, holds the swapped-out bytes.
SOCK3="$WORK/sock3"
"$R/kiwi-arbiter" --socket-dir "$SOCK3" --tq 2 --swap-pool-floor 20GiB 2>"$WORK/arbiter3.log" &
ARB3=$!
for _ in $(seq 100); do [ -S "$SOCK3/client/arbiter.sock" ] && break; sleep 0.1; done
for _ in $(seq 600); do
  "$R/kiwictl" --socket-dir "$SOCK3" status --json 2>/dev/null | python3 -c 'import json,sys; p=json.load(sys.stdin).get("swap_pool") or {}; sys.exit(0 if p.get("ready_bytes",0) >= 20480<<20 else 1)' && break
  sleep 0.1
done
# cgroup v2, else v1's memory controller.
CG=""; CGV=""
if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null && mkdir -p /sys/fs/cgroup/kiwi-validate-pool 2>/dev/null \
   && echo $((4 << 30)) >/sys/fs/cgroup/kiwi-validate-pool/memory.max 2>/dev/null; then
  CG=/sys/fs/cgroup/kiwi-validate-pool; CGV=2
elif [ -d /sys/fs/cgroup/memory ] && mkdir -p /sys/fs/cgroup/memory/kiwi-validate-pool 2>/dev/null \
   && echo $((4 << 30)) >/sys/fs/cgroup/memory/kiwi-validate-pool/memory.limit_in_bytes 2>/dev/null; then
  CG=/sys/fs/cgroup/memory/kiwi-validate-pool; CGV=1
fi
in_cgroup() { if [ -n "$CG" ]; then sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CG" "$@"; else "$@"; fi; }
in_cgroup timeout "$T" "$R/kiwictl" --socket-dir "$SOCK3" run -- "$R/gpuburst" --mem 18GiB --bursts 4 --gpu-ms 1500 --cpu-ms 2000 --name P --seed 11 >"$WORK/pool-p.out" 2>&1 & PP=$!
sleep 15
timeout "$T" "$R/kiwictl" --socket-dir "$SOCK3" run -- "$R/gpuburst" --mem "$((TOTAL_MIB - 4096))MiB" --bursts 4 --gpu-ms 1500 --cpu-ms 2000 --name Q --seed 12 >"$WORK/pool-q.out" 2>&1 & PQ=$!
rp=0; wait $PP || rp=$?; rq=0; wait $PQ || rq=$?
"$R/kiwictl" --socket-dir "$SOCK3" events >"$WORK/events-pool.jsonl" || true
kill -TERM "$ARB3" 2>/dev/null || true
case "$CGV" in
  2) ooms=$(awk '/^oom_kill /{print $2}' "$CG/memory.events"); peakf="$CG/memory.peak" ;;
  1) ooms=$(awk '/^oom_kill /{print $2}' "$CG/memory.oom_control"); peakf="$CG/memory.max_usage_in_bytes" ;;
  *) ooms="no cgroup (could not make one)"; peakf=/nonexistent ;;
esac
peak=$( [ -r "$peakf" ] && echo "$(( $(cat "$peakf") >> 20 )) MiB" || echo "unknown")
[ -n "$CG" ] && rmdir "$CG" 2>/dev/null || true
pool_result="exits P $rp, Q $rq; verified $(cat "$WORK"/pool-*.out | grep -c 'all bytes as expected' || true); cgroup v${CGV:-?} ${CG:-none} (limit 4 GiB): OOM kills ${ooms}, peak ${peak}; $(grep -m1 'swap pool:' "$WORK/arbiter3.log" | sed 's/^\[INFO\] //'); $(python3 - "$WORK/events-pool.jsonl" <<'PY'
import sys, json
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
outs = [e["kind"] for e in ev if e["kind"]["event"] == "swap_out" and e["kind"]["bytes"] > 0]
if outs:
    o = outs[0]
    rate = o["bytes"] / max(o["duration_ns"], 1)
    verdict = "meets" if rate >= 20 else "misses"
    print(f"first swap-out {o['bytes']>>20} MiB at {rate:.1f} GB/s ({verdict} the 20 GB/s goal); later: " + ", ".join(f"{x['bytes']/max(x['duration_ns'],1):.1f}" for x in outs[1:6]) + " GB/s")
else:
    print("no swap-out")
PY
)"
echo "$pool_result"
fi

"$R/kiwictl" --socket-dir "$SOCK" events >"$WORK/events.jsonl" || true
swaps=$(python3 - "$WORK/events.jsonl" <<'PY'
import sys, json
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
kind = lambda e: e["kind"]["event"]
ob = od = ib = idd = 0
for e in ev:
    k = e["kind"]
    if kind(e) == "swap_out": ob += k["bytes"]; od += k["duration_ns"]
    if kind(e) == "swap_in": ib += k["bytes"]; idd += k["duration_ns"]
print(f"swap-out {ob/max(od,1):.2f} GB/s over {ob>>20} MiB, swap-in {ib/max(idd,1):.2f} GB/s over {ib>>20} MiB")
# Hand-offs: a drop, to the swap-in (reported when done) of the next client granted,
# against the slower of the dropped client's swap-out and that swap-in.
hand = []
for i, e in enumerate(ev):
    if kind(e) != "drop":
        continue
    later = ev[i + 1:]
    g = next((f for f in later if kind(f) == "grant" and f["client"] != e["client"]), None)
    if g is None:
        continue
    si = next((f for f in later if kind(f) == "swap_in" and f["client"] == g["client"] and f["t_ns"] >= g["t_ns"]), None)
    so = next((f for f in later if kind(f) == "swap_out" and f["client"] == e["client"]), None)
    if si and so:
        h = (si["t_ns"] - e["t_ns"]) / 1e6
        base = max(so["kind"]["duration_ns"], si["kind"]["duration_ns"]) / 1e6
        hand.append(f"{h:.0f} ms vs {base:.0f} ms ({h/max(base,1e-9):.2f}x; out {so['kind']['bytes']>>20} MiB, in {si['kind']['bytes']>>20} MiB)")
print("hand-offs, a drop to the next holder's swap-in done, vs max(swap-out, swap-in): " + ("; ".join(hand) if hand else "none"))
PY
)
echo "$swaps"

costs=$(unless costs "skipped: no python3 with torch"); rules="$costs"
if want costs && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== the driver's costs (what the simulator charges), no Kiwi"
  timeout 300 python3 scripts/gpu-costs.py 4 >"$WORK/costs.txt" 2>&1 || true
  cat "$WORK/costs.txt"; costs=$(cat "$WORK/costs.txt")
  echo "== which calls break a stream capture, no Kiwi"
  timeout 120 python3 scripts/gpu-capture-rules.py >"$WORK/capture.txt" 2>&1 || true
  cat "$WORK/capture.txt"; rules=$(cat "$WORK/capture.txt")
fi

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC') — ${GPU_NAME}, driver ${DRIVER}"
  echo
  echo "- gpuburst pair at 60% of ${TOTAL_MIB} MiB each: ${burst_result}"
  echo "- PyTorch pair under kiwictl run: ${torch_result}"
  echo "- PyTorch pair with expandable_segments:True at 60% each: ${expand_result}"
  echo "- newcomer's torch.cuda beside an idle notebook at 95%: ${newcomer_result}"
  echo "- the runtime's kernels loaded lazily, as the shim measured them (PyTorch, KIWI_LOG=debug): ${lazy_result}"
  echo "- two JAX processes with default preallocation: ${jax_result}"
  echo "- CuPy managed memory beside a gpuburst competitor: ${managed_result}"
  echo "- NVML under Kiwi beside a tenant at 60% (#39): ${nvml_result}"
  echo "- kiwictl demo --gpu: ${demo_result}"
  echo "- torch.cuda.graph capture and replay under Kiwi: ${graph_result}"
  echo "- torch.multiprocessing CUDA tensor: ${ipc_result}"
  echo "- PyTorch notebooks caching ~10x their live tensors, per swap-out: ${hint_result}"
  echo "- two-GPU pair in opposite orders: ${multi_result}"
  echo "- the driver's checkpoint API, no Kiwi (scripts/gpu-checkpoint.py): ${ckpt_api}"
  echo "- a notebook at ${HOLD_MIB} MiB beside three newcomers, arbiter with --checkpoint auto: ${ckpt_result}"
  echo "- the swap pool (#37), an 18 GiB notebook in a 4 GiB memory cgroup beside a competitor, pool floor 20 GiB: ${pool_result}"
  while IFS= read -r line; do echo "- $line"; done <<<"$swaps"
  echo
  echo "The driver's costs (scripts/gpu-costs.py, 4 GiB each, no Kiwi):"
  echo
  echo '```'
  echo "$costs"
  echo '```'
  echo
  echo "Calls made during a stream capture (scripts/gpu-capture-rules.py, no Kiwi):"
  echo
  echo "$rules"
} >>docs/gpu-validation.md
echo "results appended to docs/gpu-validation.md"
[ "$ra" = 0 ] && [ "$rb" = 0 ]
