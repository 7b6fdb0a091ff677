#!/bin/bash
# Alternated A/B of bench_objects.py (base = /work/wt/base, new = /work/wt/l), each from its own folder.
out=/tmp/l_ab/$1; mkdir -p $out; shift
run() { # tree label workload
  local dir=$1 label=$2 wl=$3
  echo "=== $label $wl $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.md
  (cd $dir && PYTHONPATH=$dir PYTHONPYCACHEPREFIX=/tmp/l_pyc_$label nice -n 19 ionice -c3 timeout 900 \
     /work/main/.venv/bin/python benchmarks/bench_objects.py --workload $wl --repeats 2 \
     --methods gather_object,dropin,gather 2>>$out/stderr.log | tail -9 >> $out/log.md)
}
for wl in "$@"; do
  run /work/wt/base base $wl; run /work/wt/l new $wl; run /work/wt/l new $wl; run /work/wt/base base $wl
done
echo "=== done $(date -u +%T)" >> $out/log.md
