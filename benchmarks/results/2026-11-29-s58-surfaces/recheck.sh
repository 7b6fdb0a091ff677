#!/bin/bash
PY=/work/main/.venv/bin/python
run() { local tree=$1 label=$2; shift 2
  echo "### $label $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  (cd $tree && PYTHONPATH=$tree $PY benchmarks/bench_objects.py "$@" 2>&1 | grep -E "^\| (gather|dropin|gather_object|[0-9])"); }
M=/work/main; B=/work/wt/base58
for t in $M $B; do (cd $t && $PY -m compileall -q spillmerge >/dev/null); done
for i in 1 2; do
  run $M "main gather coco" --workload coco --methods gather_object,gather --repeats 3
  run $B "base gather coco" --workload coco --methods gather_object,gather --repeats 3
  run $B "base dropin llm" --workload llm --methods gather_object,dropin --repeats 3
  run $M "main dropin llm" --workload llm --methods gather_object,dropin --repeats 3
  run $M "main floor coco" --workload coco --floor --repeats 3
  run $B "base floor coco" --workload coco --floor --repeats 3
done
echo DONE
