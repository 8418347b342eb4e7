#!/usr/bin/env bash
# Launch train.py with torchrun.
#
#   ./launch.sh --profile h100 [train.py flags]     one node, one process per visible GPU
#   ./launch.sh --profile cpu [train.py flags]      2 CPU processes on gloo (NPROC_PER_NODE to change)
#   sbatch --nodes=2 --gpus-per-node=8 launch.sh --profile h100x4 [flags]
#                                                    SLURM: one torchrun per node, c10d rendezvous
#                                                    on the first node of the allocation
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh --profile h100x4 [flags]    on node 0,
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch.sh --profile h100x4 [flags]    on node 1:
#                                                    several nodes without SLURM, torchrun's
#                                                    convention; c10d rendezvous on node 0
#
# It exits with the run's own code (0 done, 2 bad input, 3 diverged, 4 checkpoint write failed,
# 5 out of memory, 75 preempted), printing a bad input's `error:` line once: torchrun runs inside
# latentwire.harness.launch, which reads each rank's outcome (plain torchrun exits 1 whatever happened).
#
# Preemption: SIGTERM or SIGUSR1 to this script reaches the training processes as SIGTERM, and
# SIGHUP (an ssh connection dropped, a terminal closed) as SIGHUP; they finish the step, save it and
# exit with code 75. Under SLURM that comes 120 s before the time
# limit (or on scancel --signal=USR1 / preemption); the script then requeues the job, and the
# requeued job adds --requeued by itself: it resumes where the run saved, and starts the run where
# it never did (preempted while loading). On every node the signal goes from latentwire.harness.launch
# straight to its ranks, which take as long as the save needs: torchrun itself is never told, so
# its shutdown timeout (fixed at 30 s before torch 2.13) does not apply.
#
# Restarts: a rank that dies (a GPU fault, the OOM killer, a node lost) does not end the run: torchrun
# starts every rank again, up to MAX_RESTARTS times (default 3; 0 for none), and they resume from the
# newest checkpoint, or start the run if it never saved, as a requeued job does. A run that a rank
# ended on purpose (a bad input, divergence, a failed checkpoint write, out of memory, a signal
# above) is not restarted. The exit code and error line are the last attempt's.
#
# Environment it reads: NPROC_PER_NODE (processes per node), MASTER_PORT (rendezvous port, 29500),
# NNODES, NODE_RANK, MASTER_ADDR (several nodes without SLURM: how many, which one this is, and
# node 0's address, which every node must reach), LOCAL_ADDR (the address this node is reached at,
# where its hostname does not resolve to it; with several interfaces also set GLOO_SOCKET_IFNAME /
# NCCL_SOCKET_IFNAME to the one the nodes share), RDZV_ID (the run's name at the rendezvous),
# MAX_RESTARTS (torchrun's restarts, above), PYTHON (the interpreter; default: the checkout's .venv,
# else python3).
#
# train.py's own flags: python train.py --help (with --profile KEY: that profile's values).
#
#SBATCH --job-name=latentwire
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail

# --help: the header above, as usage.
for arg in "$@"; do
    if [[ "$arg" == --help || "$arg" == -h ]]; then
        sed -n '2,/^#SBATCH/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
    fi
done

# The checkout this script lives in (under sbatch, the copy SLURM runs is elsewhere, so fall back
# to the submission directory).
if [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_SUBMIT_DIR:-}" && ! -f "$(dirname "$0")/train.py" ]]; then
    ROOT="$SLURM_SUBMIT_DIR"
else
    ROOT="$(cd "$(dirname "$0")" && pwd)"
fi
if [[ -z "${PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON="$ROOT/.venv/bin/python"
fi
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

profile=""
profiles="$ROOT/hw_profiles.json"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --profile) profile="${args[i + 1]:-}" ;;
        --profile=*) profile="${args[i]#--profile=}" ;;
        --hw-profiles) profiles="${args[i + 1]:-}" ;;
        --hw-profiles=*) profiles="${args[i]#--hw-profiles=}" ;;
    esac
done
if [[ -z "$profile" ]]; then
    echo "error: launch.sh needs --profile KEY (a key of hw_profiles.json)" >&2
    exit 2
fi
device="$("$PYTHON" -c 'import sys
from pathlib import Path
from latentwire.settings import Config
from latentwire.harness.config import read_profiles
from latentwire.harness.errors import UserError
try:
    path = Path(sys.argv[2])
    print(Config.schema().resolve_profile(read_profiles(path), sys.argv[1], path)["device"])
except UserError as e:
    sys.exit(f"error: {e}")' "$profile" "$profiles")" || exit 2

# --- processes per node ----------------------------------------------------------------------
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
    nproc="$NPROC_PER_NODE"
elif [[ "$device" == "cpu" ]]; then
    nproc=2
elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    nproc=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
else
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [[ -n "${NPROC_PER_NODE:-}" && ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'" >&2
    exit 2
fi
restarts="${MAX_RESTARTS:-3}"
if [[ ! "$restarts" =~ ^(0|[1-9][0-9]*)$ ]]; then
    echo "error: MAX_RESTARTS must be a whole number, got '$restarts'" >&2
    exit 2
fi
if [[ -z "$nproc" || "$nproc" -lt 1 ]]; then
    echo "error: profile $profile needs a GPU and none is visible (set NPROC_PER_NODE to override)" >&2
    exit 2
fi

# --- environment the field recommends --------------------------------------------------------
# Expandable segments let the caching allocator grow a segment instead of fragmenting memory
# across variable-length batches (fewer out-of-memory errors at the same peak).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# One process per GPU must not each spawn a thread per core: split the cores between them.
cores=$(nproc --all)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}"
# A failed or hung NCCL collective raises instead of blocking forever (the process group's
# timeout then ends the job); WARN surfaces transport problems without flooding the log.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"  # DataLoader workers fork after tokenizers load

# Wait for a background process; a trapped signal interrupts `wait`, so wait again until it has
# exited, and return its exit code.
wait_for() {
    while kill -0 "$1" 2>/dev/null; do wait "$1" || true; done
    wait "$1"  # bash keeps an exited child's status for this
}

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # --- SLURM: one torchrun per node; every node meets at the first node's rendezvous ------
    nodes="${SLURM_NNODES:-1}"
    head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    port="${MASTER_PORT:-29500}"
    resume=()
    if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 && " $* " != *" --resume "* ]]; then
        resume=(--requeued)  # a requeued job resumes where the preempted one saved, or starts if it never did
    fi
    echo "launch.sh: SLURM job $SLURM_JOB_ID, $nodes node(s) x $nproc process(es), rendezvous $head_node:$port"
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
        "$PYTHON" -m latentwire.harness.launch --nnodes="$nodes" --nproc_per_node="$nproc" --max-restarts="$restarts" \
        --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:$port" \
        "$ROOT/train.py" "$@" ${resume[@]+"${resume[@]}"} &  # an empty array is "unbound" to bash < 4.4
    step_pid=$!
    preempted=0
    # srun passes SIGTERM on to each node's latentwire.harness.launch, which passes it to its ranks.
    trap 'preempted=1; kill -TERM "$step_pid" 2>/dev/null || true' USR1 TERM HUP
    status=0
    wait_for "$step_pid" || status=$?
    if [[ "$preempted" == 1 ]]; then
        echo "launch.sh: preempted; requeueing job $SLURM_JOB_ID to resume"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit "$status"
fi
# --- one node, or several without SLURM ------------------------------------------------------
nnodes="${NNODES:-1}"
if [[ ! "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NNODES must be a positive integer, got '$nnodes'" >&2
    exit 2
fi
if [[ "$nnodes" == 1 ]]; then
    rendezvous=(--standalone)
    echo "launch.sh: 1 node x $nproc process(es) ($device)"
else
    node_rank="${NODE_RANK:-}"
    if [[ ! "$node_rank" =~ ^(0|[1-9][0-9]*)$ || "$node_rank" -ge "$nnodes" ]]; then
        echo "error: with NNODES=$nnodes, NODE_RANK must be 0 to $((nnodes - 1)), got '$node_rank'" >&2
        exit 2
    fi
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        echo "error: with NNODES=$nnodes, MASTER_ADDR must name node 0's address" >&2
        exit 2
    fi
    # c10d hosts the rendezvous store where the endpoint names this host; MASTER_ADDR may be an
    # address the host does not recognise as its own, so node 0 says it hosts (c10d ignores
    # --node-rank: ranks follow the order nodes join).
    rendezvous=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}"
                --rdzv-id="${RDZV_ID:-latentwire}" --rdzv-conf="is_host=$([[ "$node_rank" == 0 ]] && echo true || echo false)")
    if [[ -n "${LOCAL_ADDR:-}" ]]; then
        rendezvous+=(--local-addr="$LOCAL_ADDR")
    fi
    echo "launch.sh: node $node_rank of $nnodes x $nproc process(es) ($device), rendezvous $MASTER_ADDR:${MASTER_PORT:-29500}"
fi
"$PYTHON" -m latentwire.harness.launch "${rendezvous[@]}" --nproc_per_node="$nproc" --max-restarts="$restarts" \
    "$ROOT/train.py" "$@" &
launcher_pid=$!
trap 'kill -TERM "$launcher_pid" 2>/dev/null || true' USR1 TERM  # latentwire.harness.launch passes it to the ranks
# A hangup may reach this script alone (it leads the session of `ssh -t host ./launch.sh`) or the
# launcher too (a login shell hangs up its jobs): the ranks hear it once however often it comes.
trap 'kill -HUP "$launcher_pid" 2>/dev/null || true' HUP
# Ctrl-C reaches the launcher as it reaches this shell (one process group): the shell waits for the
# ranks to save and exit 130 (at once on a second Ctrl-C), then exits with that code.
trap ':' INT
status=0
wait_for "$launcher_pid" || status=$?
exit "$status"
