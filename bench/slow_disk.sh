#!/usr/bin/env bash
# Run a command with the disk's write bandwidth capped (Linux cgroup v1 blkio throttle on the
# root cgroup, root only), to measure where the disk, not the CPU, binds; the cap is removed
# when the command ends, however it ends. It affects every process writing to that device.
#   bench/slow_disk.sh 250000000 .venv/bin/python bench/capture_bench.py --sizes large
set -euo pipefail
bps="$1"; shift
knob=/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device
[ -w "$knob" ] || { echo "slow_disk.sh: $knob is not writable (needs root and cgroup v1 blkio)" >&2; exit 2; }
dev=$(findmnt -no MAJ:MIN -T "${DSTT_BENCH_DIR:-${TMPDIR:-/tmp}}")
dev="${dev%%:*}:0"  # the whole disk, not a partition
trap 'echo "$dev 0" > "$knob"' EXIT
echo "$dev $bps" > "$knob"
echo "slow_disk.sh: writes to $dev capped at $bps bytes/s" >&2
"$@"
