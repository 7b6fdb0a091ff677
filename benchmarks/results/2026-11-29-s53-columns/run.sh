#!/bin/bash
# main vs base53 (2005385), each tree's benchmark from its own folder, alternated
PY=/work/main/.venv/bin/python
run() { local tree=$1 label=$2; shift 2
  echo "### $label $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $tree && PYTHONPATH=$tree $PY benchmarks/bench_objects.py "$@" 2>&1 | grep -A9 "^W=\|one process"); }
M=/work/main; B=/work/wt/base53
for t in $M $B; do (cd $t && $PY -m compileall -q spillmerge >/dev/null); done
for w in llm coco; do
  run $M "main gather $w" --workload $w --methods gather_object,gather --repeats 3 --check
  run $B "base gather $w" --workload $w --methods gather_object,gather --repeats 3
  run $B "base gather $w" --workload $w --methods gather_object,gather --repeats 3
  run $M "main gather $w" --workload $w --methods gather_object,gather --repeats 3
done
for w in llm coco; do
  run $M "main dropin $w" --workload $w --methods gather_object,dropin --repeats 3 --check
  run $B "base dropin $w" --workload $w --methods gather_object,dropin --repeats 3
done
for w in llm coco; do
  run $M "main floor $w" --workload $w --floor --repeats 3
  run $B "base floor $w" --workload $w --floor --repeats 3
  run $B "base floor $w" --workload $w --floor --repeats 3
  run $M "main floor $w" --workload $w --floor --repeats 3
done
run $M "main megatron" --workload megatron --methods all_gather_object,dropin --repeats 1
run $B "base megatron" --workload megatron --methods all_gather_object,dropin --repeats 1
for t in $M $B; do echo "### tiny $t"; (cd $t && TREE=$t $PY benchmarks/results/2026-11-29-s53-columns/tiny.py.txt 2>&1 | tail -1); done
for t in $M $B $B $M; do
  echo "### bench_gather $t $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $t && PYTHONPATH=$t $PY benchmarks/bench_gather.py --methods spillmerge,raw_spill --repeats 3 2>&1 | grep -v "^  repeat" | tail -12)
done
echo DONE
