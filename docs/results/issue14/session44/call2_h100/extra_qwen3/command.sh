# Session 44, call 2's follow-up on the same warm H100 (the call's decode_layers runs had been cut by its
# time-outs after the GPU tests ran long): Qwen3-0.6B's layers alone, the tree, then 4aa30a6, then f1c4f48.
export PYTHONUNBUFFERED=1; for t in . .gpu/old .gpu/mid; do (cd $t && PYTHONPATH=$PWD timeout 55 python3 benchmarks/decode_layers.py --presets qwen3-0.6b --replays 100 --out $OUT/q_$(basename $t) > $OUT/q_$(basename $t).log 2>&1; echo "== $t rc $?"; grep -v Warn $OUT/q_$(basename $t).log | grep -E "^qwen3|phases|parts" | cut -c1-330); done
