#!/bin/bash
# main vs base59 (8489147, the session start), each tree's benchmark from its own folder, alternated
PY=/work/main/.venv/bin/python
run() { local tree=$1 label=$2; shift 2
  echo "### $label $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $tree && PYTHONPATH=$tree $PY benchmarks/bench_objects.py "$@" 2>&1 | grep -E "^\| (gather|dropin|gather_object|[0-9])"); }
M=/work/main; B=/work/wt/base59
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
  run $M "main floor $w" --workload $w --floor --repeats 3
  run $B "base floor $w" --workload $w --floor --repeats 3
done
for t in $M $B; do echo "### tiny $t"; (cd $t && TREE=$t $PY /tmp/s51/tiny4.py 2>&1 | tail -1); done
for t in $M $B $B $M; do
  echo "### bench_gather $t $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $t && PYTHONPATH=$t $PY benchmarks/bench_gather.py --methods spillmerge,raw_spill --repeats 3 2>&1 | grep -E "^\| (spillmerge|raw_spill)")
done
for t in $M $B; do
  echo "### bench_write $t $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $t && PYTHONPATH=$t $PY benchmarks/bench_write.py --e2e --repeats 3 2>&1 | grep -v "^  " | tail -14)
done
echo DONE
