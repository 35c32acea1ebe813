#!/usr/bin/env bash
# pytgi's GPU checks and benchmarks in one command, for a machine with an H100/H200, no network,
# and its own CUDA torch, triton and transformers (bench/README.md, "GPU"). Sized for a
# quarter-hour GPU window: the whole run takes at most 9 minutes (--budget-s 540), install
# included; stages run in order of value, each under its cap.
#
#   bash bench/gpu.sh [--stages tests,compare-8b,speculative,lora,steps,compare-1b,quantization]
#                     [--budget-s 540] [--cap STAGE=SECONDS ...] [--no-install]
#                     [--out DIR] [--work DIR] [--cpu-smoke] [--plan]
#
# Re-measuring one stage after a fix (the install is implied, and takes seconds when this
# machine already ran it with the same wheels and pyproject.toml; a fresh machine installs in
# ~20 s and rebuilds the model: 8B ~30 s):
#   bash bench/gpu.sh --stages compare-8b --budget-s 240
#
# Stages, in this order whatever order --stages names them (default: all):
#   install     (always first unless --no-install) the wheels of bench/gpu-wheels.txt from
#               .whl/ (`make gpu-wheels`) into a directory on PYTHONPATH, then pytgi itself with
#               --no-deps: the README's offline install, word for word; then every requirement
#               and every process's entry module checked; skipped when done before on this machine
#   tests       pytest on CUDA, short: the Triton kernel tests (tests/unit/shard/**/test_triton_*),
#               the CUDA-graph tests (LoRA's too) and tests/gpu/ (greedy tokens equal to
#               transformers' on the GPU); interrupted (SIGINT: its report still written) before
#               the stage's cap
#   compare-8b  the headline: python -m pytgi_bench.compare --gpu on the Llama-3-8B shape, 256
#               requests, prompts U[128,1024), 128 new tokens, the full HTTP server, against
#               transformers' continuous batching and its compiled single stream
#   speculative pytgi_bench.experiments.speculative on the 8B shape at batch 1: n-gram drafting
#               (--speculate 4) against none on prompts that quote their input, greedy, both
#               engines in one process, every output checked equal; tokens/s, acceptance
#   lora        pytgi_bench.experiments.lora_batch on the 8B shape: batch 64 spread over 8
#               rank-16 adapters (every projection; the Triton shrink/expand kernels, CUDA graphs
#               on) against the same batch on the base model (one engine: its rows on adapter 0)
#   steps       pytgi_bench.compare.engine_steps on the 1B shape: the decode step at batch 1, 64
#               and 256, overlap off and on
#   compare-1b  the compare on the Llama-3.2-1B shape (pytgi over HTTP against transformers' CB)
#   quantization  pytgi_bench.experiments.quantization: --quantize modes against bfloat16 on a
#               ~20M Llama (decode tok/s at batch 1 and 64, weight memory) and the modes' kernels
# Every pytgi run records its step timeline (--step-timeline; shard/engine/step_timeline.py):
# per step kind, where the time went (host before the launch, forward, token choice, waiting
# on the device, the gap between steps, the device's idle share), in compare-*.json and
# steps.json, summarised in summary.json's `timelines` and printed before the summary table.
# pytgi is installed editable, so pytgi_bench.compare and .experiments (not in the wheel) import
# from this checkout.
# Each stage runs under its own time cap (and the whole under --budget-s), fails loudly, and
# never stops the next one; a stage that would not get 30 s is skipped and said so.
# Results go to $OUT when set, else bench/results/gpu/ (at most 9 files: summary.json,
# steps.json, compare-1b.json, compare-8b.json, timeline-8b.jsonl (the 8B server's steps, copied
# by the summary even when the stage was cut), speculative.json, lora.json, quantization.json,
# tests.xml, gpu.log); models,
# server logs, timelines and scratch go to the work directory (/tmp/pytgi-gpu), which a warm
# machine keeps between calls. The summary table comes last; the exit status is 0 only when
# every stage run passed.
#
# --cpu-smoke: the same stages here, on the CPU, with the cpu-small model and tiny counts (the
# wheels are installed for Python 3.12 into a scratch directory but not imported; pytgi's own
# install is a dry run; caps and the default budget 4 times the GPU's), so the plumbing is
# proven before it costs GPU time.
# --plan: print the stages and their caps, run nothing.
set -uo pipefail

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
REPO="$(cd "$(dirname "$SCRIPT")/.." && pwd)"
cd "$REPO" || exit 2

ALL_STAGES=(install tests compare-8b speculative lora steps compare-1b quantization)
# Caps in seconds, summing to the default budget (540: 9 minutes). Measured on an H100
# (2026-11-23): install 16 s, tests 85 s, compare-8b 144 s with the model's build (27 s).
# speculative: not yet measured on a GPU (two 8B engines loaded and warmed, ~12 s of decoding).
# lora: not yet measured on a GPU (one 8B engine, 8 adapters written in bf16, 3 x 2 batches of
# 64 x 32 tokens); its 40 s came from compare-8b (195 -> 175, 144 measured), steps and compare-1b.
declare -A CAP=([install]=30 [tests]=90 [compare-8b]=175 [speculative]=60 [lora]=40 [steps]=50
                [compare-1b]=50 [quantization]=45)
DEFAULT_BUDGET_S=540
# --cpu-smoke runs under caps this many times the GPU's (and --budget-s as given).
SMOKE_CAP_FACTOR=4
# What the summary needs at the end, and the grace a stage gets between TERM and KILL.
RESERVE_S=20
KILL_AFTER_S=20
MIN_STAGE_S=30
SERVER_STOP_S=20

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SCRIPT"; }

# ---- stage bodies (run as `gpu.sh --run-stage NAME` under `timeout`) ------------------------

ensure_model() {  # SHAPE -> prints the model directory
    "$PY" -m pytgi_bench.compare.build_model --shape "$1" --root "$WORK/models" \
        --record "$WORK/models.jsonl" | tail -n 1
}

shapes_for() {  # the shapes a stage runs on: the GPU ones, or cpu-small in the smoke run
    if [[ $SMOKE == 1 ]]; then echo cpu-small; else echo "$@"; fi
}

install_stamp() {  # what an install depends on: the wheel list, the wheels, pytgi's metadata
    { cat bench/gpu-wheels.txt pyproject.toml; ls .whl; echo "smoke=$SMOKE"; } | sha256sum \
        | cut -c1-16
}

stage_install() {
    if ! compgen -G ".whl/*.whl" > /dev/null; then
        echo "no wheels in .whl/: run 'make gpu-wheels' on a machine with network, then carry .whl"
        return 1
    fi
    local stamp
    stamp="$(install_stamp)"
    if [[ -f $SITE/.pytgi-install && "$(cat "$SITE/.pytgi-install")" == "$stamp" ]] \
        && "$PY" -c "import pytgi_launcher.cli, pytgi_bench.compare" 2> /dev/null; then
        echo "installed earlier on this machine from the same wheels and pyproject.toml" \
            "($SITE): skipped"
        return 0
    fi
    local tags=()
    if [[ $SMOKE == 1 ]]; then
        # The GPU machine's interpreter, as `make gpu-wheels` downloads for it: proves the list
        # resolves from .whl without using them.
        read -ra tags <<< "$(make -s --no-print-directory -C "$REPO" gpu-wheel-tags)"
        [[ ${#tags[@]} -gt 0 ]] || return 1
    fi
    rm -rf "$SITE" && mkdir -p "$SITE"
    # The README's offline install ("On a GPU"), command for command.
    echo "+ pip install --no-index --no-deps --find-links .whl --target $SITE" \
        "-r bench/gpu-wheels.txt"
    "$PY" -m pip install -q --no-index --no-deps --find-links .whl --target "$SITE" \
        -r bench/gpu-wheels.txt "${tags[@]}" || return 1
    echo "$(find "$SITE" -maxdepth 1 -name '*.dist-info' | wc -l) distributions in $SITE"
    local rc=0
    if [[ $SMOKE == 1 ]]; then
        echo "+ pip install --dry-run --no-index --no-deps --no-build-isolation -e .  (smoke)"
        "$PY" -m pip install -q --dry-run --no-index --no-deps --no-build-isolation -e . || rc=1
    else
        echo "+ pip install --no-index --no-deps --no-build-isolation -e ."
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    fi
    # What the machine brings (listed in the wheel file) is checked, not walked into.
    "$PY" -m pytgi_bench.requirements_check --json "$WORK/requirements.json" \
        --trust $(sed -n 's/^# provided: //p' bench/gpu-wheels.txt) || rc=1
    echo "+ import every process's entry module, the test clients and the benchmarks' parts"
    "$PY" -c "import pytgi_launcher.cli, pytgi_router.cli, pytgi_shard.service.cli, pytgi_router.http.app, \
pytgi_shard.service.server, openai, text_generation, pytest_timeout, grpc_health.v1.health, \
opentelemetry.exporter.otlp.proto.grpc.trace_exporter, pytgi_bench.cli, pytgi_bench.compare, \
pytgi_bench.experiments; print('imports: ok')" || rc=1
    ((rc == 0)) && echo "$stamp" > "$SITE/.pytgi-install"
    return $rc
}

tests_files() {  # the CUDA tests: equality with transformers first, then kernels and graphs
    echo tests/gpu/
    find tests/unit/shard -name 'test_triton_*.py' | sort
    echo tests/unit/shard/engine/test_graph_runner.py
    echo tests/unit/shard/engine/test_verify_graphs.py
    echo tests/unit/shard/lora/test_lora_graph_buffers.py
}

merge_junit() {  # OUT WORK/tests-*.xml: one report of the groups' suites (stdlib only)
    "$PY" - "$@" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

merged = ET.Element("testsuites")
for path in sys.argv[2:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        continue
    merged.extend([root] if root.tag == "testsuite" else list(root))
ET.ElementTree(merged).write(sys.argv[1])
PYEOF
}

stage_tests() {
    local files=() f
    if [[ $SMOKE == 1 ]]; then
        # Skipped on the CPU: the plumbing only (two files: both groups run).
        files=(tests/gpu/test_cuda_equality.py tests/gpu/test_quantized_weights_cuda.py)
    else
        "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || return 1
        while IFS= read -r f; do [[ -e $f ]] && files+=("$f"); done < <(tests_files)
    fi
    # Two pytest processes, the files dealt alternately: the kernels' Triton compiles are the
    # CPU's work and the machine has 16 cores (182 tests on 2026-11-26; 126 took 85 s in one
    # process on the H100, 2026-11-23). Each gets SIGINT before the stage's cap: it stops and
    # still writes its report and XML.
    local limit=$((${STAGE_CAP:-90} - 10)) group i pids=() rc=0
    local -a groups=("" "")
    for i in "${!files[@]}"; do groups[$((i % 2))]+="${files[$i]} "; done
    rm -f "$WORK"/tests-*.xml "$WORK"/tests-*.log
    for group in 0 1; do
        [[ -n ${groups[$group]} ]] || continue
        echo "+ pytest ${groups[$group]}(interrupted after ${limit} s)"
        # shellcheck disable=SC2086  # the group is a list of paths without spaces
        timeout --signal=INT --kill-after=8 "$limit" "$PY" -m pytest -q -rfEs \
            -p no:cacheprovider --timeout 60 --durations 10 \
            --junitxml="$WORK/tests-$group.xml" ${groups[$group]} > "$WORK/tests-$group.log" 2>&1 &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || rc=$?; done
    cat "$WORK"/tests-*.log
    merge_junit "$OUT/tests.xml" "$WORK"/tests-*.xml
    return $rc
}

pick_attention() {  # triton on a GPU when pytgi has it (asked after the install stage)
    if [[ $SMOKE == 1 ]]; then echo reference; return; fi
    "$PY" -c 'from pytgi_bench.compare.settings import default_attention as d; print(d())' \
        2>/dev/null || echo reference
}

stage_steps() {  # the 1B decode step (the 8B's steps are compare-8b's timeline)
    local rc=0 shape model sizes=1,64,256 steps=16 ATTN
    ATTN="$(pick_attention)"
    [[ $SMOKE == 1 ]] && sizes=1,4 && steps=4
    mkdir -p "$WORK/steps" && rm -f "$WORK"/steps/*.json
    for shape in $(shapes_for 1b); do
        model="$(ensure_model "$shape")" && [[ -n $model ]] || { rc=1; continue; }
        echo "+ engine_steps $shape --attention $ATTN --batch-sizes $sizes --timeline on"
        "$PY" -m pytgi_bench.compare.engine_steps --model "$model" --attention "$ATTN" \
            --batch-sizes "$sizes" --steps "$steps" --timeline on \
            --out "$WORK/steps/$shape-$ATTN.json" || rc=1
    done
    return $rc
}

stage_compare() {  # SHAPE
    local shape="$1" model args ATTN
    ATTN="$(pick_attention)"
    model="$(ensure_model "$(shapes_for "$shape")")" && [[ -n $model ]] || return 1
    args=(--model "$model" --work-dir "$WORK/compare-$shape" --out "$OUT/compare-$shape.json"
          --note "bench/gpu.sh compare-$shape")
    if [[ $SMOKE == 1 ]]; then
        # transformers' CB sizes its cache from accelerator memory: here, its patched-probe row.
        args+=(--shape cpu-small --systems pytgi-http-b1,pytgi-http,hf-compiled-b1,hf-cb-cpu-patched
               --requests 8 --new-tokens 8 --single-requests 2 --single-input-len 32
               --single-new-tokens 8 --repeats 1 --system-timeout-s 120)
    else
        # A transformers row that outlives this is cut (its compile on the 8B shape is ~a minute).
        # The 1B stage leaves out the compiled single stream (the 8B's is the baseline that
        # matters; the 1B step is the steps stage's).
        local row_cap=60
        [[ $shape == 8b ]] && row_cap=150
        [[ $shape == 1b ]] && args+=(--systems pytgi-http-b1,pytgi-http,hf-cb)
        args+=(--gpu --shape "$shape" --attention "$ATTN" --system-timeout-s "$row_cap")
    fi
    echo "+ python -m pytgi_bench.compare ${args[*]}"
    "$PY" -m pytgi_bench.compare "${args[@]}"
}

stage_speculative() {  # the 8B shape at batch 1, n-gram drafts on quoting prompts
    local model args
    model="$(ensure_model "$(shapes_for 8b)")" && [[ -n $model ]] || return 1
    args=(--model "$model" --workloads "quoting, batch 1" --repeats 2 --out "$OUT/speculative.json")
    [[ $SMOKE == 1 ]] && args+=(--repeats 1)
    echo "+ python -m pytgi_bench.experiments.speculative ${args[*]}"
    "$PY" -m pytgi_bench.experiments.speculative "${args[@]}"
}

stage_lora() {  # the 8B shape: 8 rank-16 adapters over a batch of 64 against the base model
    local model args
    model="$(ensure_model "$(shapes_for 8b)")" && [[ -n $model ]] || return 1
    args=(--model "$model" --same-engine --threads 4 --repeats 3 --out "$OUT/lora.json")
    [[ $SMOKE == 1 ]] && args+=(--batch 8 --max-new 4 --repeats 1)
    echo "+ python -m pytgi_bench.experiments.lora_batch ${args[*]}"
    "$PY" -m pytgi_bench.experiments.lora_batch "${args[@]}"
}

stage_quantization() {
    local args=(--root "$WORK/models" --out "$OUT/quantization.json")
    # The smoke run: two modes, tiny counts, no kernel table.
    if [[ $SMOKE == 1 ]]; then
        args+=(--modes float,eetq --rounds 1 --steps 2 --batch-sizes 1,4 --no-kernels)
    else
        # One round of the modes the wheels carry (bitsandbytes' is not in .whl/).
        args+=(--modes float,fp8,eetq,gptq,awq --rounds 1)
    fi
    echo "+ python -m pytgi_bench.experiments.quantization ${args[*]}"
    "$PY" -m pytgi_bench.experiments.quantization "${args[@]}"
}

run_stage_body() {
    case "$1" in
        install) stage_install ;;
        tests) stage_tests ;;
        steps) stage_steps ;;
        compare-1b) stage_compare 1b ;;
        compare-8b) stage_compare 8b ;;
        speculative) stage_speculative ;;
        lora) stage_lora ;;
        quantization) stage_quantization ;;
        *) echo "unknown stage $1"; return 2 ;;
    esac
}

# ---- the driver ---------------------------------------------------------------------------

stop_leftover_servers() {
    # A stage killed at its cap cannot stop the pytgi server it started (its own session):
    # PytgiServer leaves the launcher's pid next to its log until it stops it.
    local pidfile pid
    while IFS= read -r pidfile; do
        pid="$(cat "$pidfile" 2>/dev/null)"
        if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
            echo "[gpu.sh] stopping a pytgi server left running (pid $pid)"
            kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
            for _ in $(seq "$SERVER_STOP_S"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
            kill -KILL -- "-$pid" 2>/dev/null
        fi
        rm -f "$pidfile"
    done < <(find "$WORK" -name 'pytgi-server.pid' 2>/dev/null)
}

check_seconds() {  # FLAG VALUE: whole seconds, or a usage error
    if ! [[ $2 =~ ^[0-9]+$ ]]; then
        echo "gpu.sh: $1 takes whole seconds, got '$2'" >&2
        exit 2
    fi
}

main() {
    if [[ ${1:-} == --run-stage ]]; then run_stage_body "$2"; exit $?; fi
    local stages_arg="" budget="" plan=0 install=1
    SMOKE=0
    local out_arg="" work_arg=""
    declare -A GIVEN=()
    while (($#)); do
        case "$1" in
            --stages) stages_arg="$2"; shift 2 ;;
            --budget-s) budget="$2"; shift 2 ;;
            --cap) CAP[${2%%=*}]="${2#*=}"; GIVEN[${2%%=*}]=1; shift 2 ;;
            --out) out_arg="$2"; shift 2 ;;
            --work) work_arg="$2"; shift 2 ;;
            --no-install) install=0; shift ;;
            --cpu-smoke) SMOKE=1; shift ;;
            --plan) plan=1; shift ;;
            -h|--help) usage; exit 0 ;;
            *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
        esac
    done

    local selected=() s
    IFS=',' read -r -a wanted <<< "${stages_arg:-$(IFS=,; echo "${ALL_STAGES[*]}")}"
    for s in "${wanted[@]}"; do
        if [[ -z ${CAP[$s]+x} ]]; then
            echo "gpu.sh: unknown stage '$s' (${ALL_STAGES[*]})" >&2
            exit 2
        fi
    done
    # install is implied (it skips itself when this machine has it), --no-install drops it.
    local chosen=",${stages_arg:-$(IFS=,; echo "${ALL_STAGES[*]}")},"
    ((install)) && chosen+="install,"
    [[ $install == 0 ]] && chosen="${chosen//,install,/,}"
    for s in "${ALL_STAGES[@]}"; do
        [[ $chosen == *",$s,"* ]] && selected+=("$s")
    done

    if [[ $SMOKE == 1 ]]; then
        # The caps are the GPU's; a shared CPU runs the same plumbing several times slower.
        for s in "${!CAP[@]}"; do
            [[ -n ${GIVEN[$s]+x} ]] || CAP[$s]=$((CAP[$s] * SMOKE_CAP_FACTOR))
        done
        budget=${budget:-$((DEFAULT_BUDGET_S * SMOKE_CAP_FACTOR))}
    fi
    budget=${budget:-$DEFAULT_BUDGET_S}
    check_seconds --budget-s "$budget"
    for s in "${!CAP[@]}"; do check_seconds "--cap $s" "${CAP[$s]}"; done
    if ((plan)); then
        echo "stages: ${selected[*]} (budget ${budget} s)"
        for s in "${selected[@]}"; do echo "  $s: cap ${CAP[$s]} s"; done
        exit 0
    fi

    if [[ $SMOKE == 1 ]]; then
        WORK="${work_arg:-/tmp/pytgi-gpu-smoke}"
        OUT="${out_arg:-$WORK/results}"
        PY="${PYTHON:-$REPO/.venv/bin/python}"
    else
        WORK="${work_arg:-/tmp/pytgi-gpu}"
        OUT="${out_arg:-${OUT:-$REPO/bench/results/gpu}}"
        PY="${PYTHON:-python3}"
    fi
    mkdir -p "$WORK" "$OUT" || exit 2
    WORK="$(cd "$WORK" && pwd)"; OUT="$(cd "$OUT" && pwd)"
    SITE="$WORK/site"
    LOG="$OUT/gpu.log"
    : > "$LOG"
    export WORK OUT SITE PY SMOKE
    # No network here: anything that would ask the Hub fails at once instead of timing out.
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
    # The wheels of the install stage (the smoke run's are for another Python: not imported).
    [[ $SMOKE == 1 ]] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

    {
        echo "[gpu.sh] $(date -u +%FT%TZ) stages: ${selected[*]}; budget ${budget} s; smoke=$SMOKE"
        echo "[gpu.sh] out $OUT, work $WORK, $("$PY" -c 'import sys; print(sys.version)' 2>&1)"
        command -v nvidia-smi > /dev/null && nvidia-smi -L
        df -h "$WORK" | tail -n 1
    } 2>&1 | tee -a "$LOG"

    local start deadline stages_file="$WORK/stages.tsv"
    start=$(date +%s); deadline=$((start + budget))
    : > "$stages_file"
    for s in "${selected[@]}"; do
        local now left cap t0 rc status secs
        now=$(date +%s)
        left=$((deadline - now - RESERVE_S - KILL_AFTER_S))
        cap=${CAP[$s]}; ((cap > left)) && cap=$left
        if ((cap < MIN_STAGE_S)); then
            echo "[gpu.sh] stage $s SKIPPED: ${left} s left of the budget" | tee -a "$LOG"
            printf '%s\tskipped\t-\t0\t%s\n' "$s" "$cap" >> "$stages_file"
            continue
        fi
        echo "===== [gpu.sh] stage $s (cap ${cap} s; $((deadline - now)) s of budget left) =====" \
            | tee -a "$LOG"
        t0=$(date +%s)
        STAGE_CAP=$cap timeout --kill-after="$KILL_AFTER_S" "$cap" bash "$SCRIPT" --run-stage "$s" \
            2>&1 | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
        secs=$(($(date +%s) - t0))
        case $rc in
            0) status=ok ;;
            124|137) status=timeout ;;
            *) status=failed ;;
        esac
        echo "===== [gpu.sh] stage $s: $status (exit $rc) after ${secs} s =====" | tee -a "$LOG"
        printf '%s\t%s\t%s\t%s\t%s\n' "$s" "$status" "$rc" "$secs" "$cap" >> "$stages_file"
        stop_leftover_servers 2>&1 | tee -a "$LOG"
    done

    # As a file, with the standard library alone: the summary must come even when the install
    # stage failed (-P: bench/compare/ itself is not put on sys.path, where its module names
    # would shadow).
    "$PY" -P bench/compare/gpu_summary.py --stages "$stages_file" --work "$WORK" --out "$OUT" \
        --seconds "$(($(date +%s) - start))" 2>&1 | tee -a "$LOG"
    local summary_rc=${PIPESTATUS[0]}
    if grep -qv $'\tok\t' "$stages_file" || ((summary_rc != 0)); then exit 1; fi
    exit 0
}

main "$@"
