#!/bin/bash
# Alternated A/B (base, new, new, base per workload) of cpu_ab.py: ./cpu_ab.sh NAME REPEATS llm coco
# base = /work/wt/base (today's main), new = /work/wt/l; each run from its own checkout.
here=$(cd "$(dirname "$0")" && pwd)
out=/tmp/l_ab/$1; mkdir -p $out; reps=$2; shift 2
run() { local dir=$1 label=$2 wl=$3 k=$4
  (cd $dir && PYTHONPATH=$dir PYTHONPYCACHEPREFIX=/tmp/l_pyc_$label nice -n 19 ionice -c3 timeout 900 \
   /work/main/.venv/bin/python $here/cpu_ab.py $wl $reps $out/$wl-$label-$k.json 2>>$out/stderr.log)
  echo "$label $wl $k $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/runs.txt; }
for wl in "$@"; do
  run /work/wt/base base $wl 1; run /work/wt/l new $wl 1; run /work/wt/l new $wl 2; run /work/wt/base base $wl 2
done
echo done >> $out/runs.txt
