#!/usr/bin/env bash
# Two 2-GPU jobs crosswise and a notebook on each of two simulated GPUs, under a
# fresh arbiter, with the shapes of `kiwi-bench gang` (issue #41); keeps the
# arbiter's status and event log for reading. Needs `cargo build --release`.
#
#   scripts/gang-crosswise.sh            group turns (the ranks share KIWI_GROUP)
#   GROUPED= scripts/gang-crosswise.sh   per-GPU turns (each rank on its own)
#   CROSS= scripts/gang-crosswise.sh     job J and the notebooks only (no job K)
#   TQ=2 LIMIT=150 BURSTS=5 GPUMS=2000 IDLEMS=2000 ...
#
# Prints how long the six took (or that some were still running at LIMIT seconds,
# then killed) and the directory holding each one's report, status.txt and
# events.jsonl.
set -u
cd "$(dirname "$0")/.."
R=$PWD/target/release
W=$(mktemp -d /tmp/kiwi-gang.XXXX)
export KIWI_SIM_NAME=kiwi-gang-$$ KIWI_SIM_GPUS=2 KIWI_SIM_MEMORY=$((2 << 30))
export KIWI_SIM_CONTEXT_MEMORY=$((300 << 20)) KIWI_SIM_PCIE_GBPS=25 KIWI_SIM_HBM_GBPS=1000
export LD_LIBRARY_PATH=$R/sim
"$R/kiwi-arbiter" --socket-dir "$W/s" --tq "${TQ:-5}" >"$W/arbiter.log" 2>&1 &
ARB=$!
for _ in $(seq 100); do [ -S "$W/s/client/arbiter.sock" ] && break; sleep 0.05; done
MEM=${MEM:-$(((((2 << 30) - 2 * (300 << 20)) / 100) * 55))}
run() { # name device group exchange
    env -u KIWI_GROUP ${3:+KIWI_GROUP=$3} LD_PRELOAD="$R/libkiwi.so" KIWI_SOCKET_DIR="$W/s" \
        KIWI_REQUIRE_ARBITER=1 "$R/gpuburst" --mem "$MEM" --bursts "${BURSTS:-5}" \
        --gpu-ms "${GPUMS:-2000}" --cpu-ms 0 --idle-ms "${IDLEMS:-2000}" --json --verify \
        --device "$2" --name "$1" ${4:+--exchange "$W/$4" --exchange-timeout-ms 600000} \
        >"$W/$1.out" 2>"$W/$1.err" &
    echo $! >"$W/$1.pid"
}
G=${GROUPED-1}
run J0 0 "${G:+J}" J:0
run J1 1 "${G:+J}" J:1
PROCS="J0 J1 N0 N1"
if [ -n "${CROSS-1}" ]; then
    run K0 1 "${G:+K}" K:0
    run K1 0 "${G:+K}" K:1
    PROCS="$PROCS K0 K1"
fi
run N0 0 "" ""
run N1 1 "" ""
T0=$(date +%s)
n=6
while [ $(($(date +%s) - T0)) -lt "${LIMIT:-150}" ]; do
    n=0
    for p in $PROCS; do kill -0 "$(cat "$W/$p.pid")" 2>/dev/null && n=$((n + 1)); done
    [ "$n" = 0 ] && break
    sleep 1
done
echo "elapsed $(($(date +%s) - T0)) s, still running: $n"
KIWI_SOCKET_DIR="$W/s" "$R/kiwictl" status >"$W/status.txt" 2>&1
KIWI_SOCKET_DIR="$W/s" "$R/kiwictl" events >"$W/events.jsonl" 2>&1
for p in $PROCS; do kill -9 "$(cat "$W/$p.pid")" 2>/dev/null; done
kill "$ARB"
wait 2>/dev/null
grep -L '"ok":true' "$W"/*.out | sed 's/^/not verified: /'
echo "$W"
