#!/usr/bin/env bash
# Main against base, alternated A B B A per workload. Usage: final.sh MAIN BASE OUTFILE
M=${1:-/work/main}; B=${2:-/work/wt/base62}; OUT=${3:-/tmp/s62/final.txt}
PY=/work/main/.venv/bin/python
run() { # tree label args...
  local T=$1; shift; local L=$1; shift
  echo "### $L $(basename $T) $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT
  (cd $T && PYTHONPATH=$T $PY "$@" 2>/dev/null | grep '^|' | grep -v -- '---' | grep -v '| method' >> $OUT)
}
ab() { local L=$1; shift; run $M "$L" "$@"; run $B "$L" "$@"; run $B "$L" "$@"; run $M "$L" "$@"; }
ab "gather llm" benchmarks/bench_objects.py --workload llm --methods gather_object,gather --repeats 3
ab "dropin llm" benchmarks/bench_objects.py --workload llm --methods gather_object,dropin --repeats 3
ab "gather coco" benchmarks/bench_objects.py --workload coco --methods gather_object,gather --repeats 3
ab "floor llm" benchmarks/bench_objects.py --workload llm --floor
ab "floor coco" benchmarks/bench_objects.py --workload coco --floor
(cd $M && PYTHONPATH=$M $PY benchmarks/bench_cpu_ab.py --a $B --b $M --repeats 4 --keys 50000 --video-bytes $((512<<20)) >> $OUT 2>&1)
echo done >> $OUT
