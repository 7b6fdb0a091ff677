#!/bin/bash
# usage: ab.sh workload rounds -> alternates base/new bench_objects --floor (each its own process)
wl=$1; n=$2
for i in $(seq 1 $n); do
  for t in base o; do
    [ $((i % 2)) -eq 0 ] && t=$([ $t = base ] && echo o || echo base)
    echo "== $t round $i $(uptime | sed 's/.*load/load/')"
    cd /tmp/o && PYTHONPATH=/work/wt/$t PYTHONPYCACHEPREFIX=/tmp/o/pyc-$t nice -n 19 ionice -c3 timeout 900 /work/main/.venv/bin/python /work/wt/o/benchmarks/bench_objects.py --workload $wl --floor --repeats ${3:-2} --workdir /tmp/o/w 2>&1 | grep -E "repeat|^\| [0-9]"
  done
done
