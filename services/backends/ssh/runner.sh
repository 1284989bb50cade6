#!/usr/bin/env bash
# One node rank of a task on a host of a node pool: `bash runner.sh RANK`, started by
# node.sh `start` in a session of its own (it outlives the SSH session), with the
# cluster folder as its working directory and MJ_CLUSTER_DIR naming it.
#
# It runs setup, then (if setup exited 0) run, both in workdir/ with their output
# appended to logs/rank-RANK.log, and leaves what happened in files that are read
# over SSH after it died: phase, setup_exit, run_exit and, when the task ended on
# its own, end_time (Unix seconds). A SIGTERM (terminate, preemption notice) is
# passed to the rank's code by the process-group signal; the runner then waits for
# that code to exit and leaves no end_time, since a task that was stopped did not
# end: its cluster reads as gone, not as finished.
folder=$PWD
rank=$1
log="$folder/logs/rank-$rank.log"
stopping=0
# A trap rather than an ignored signal: children get the default action back.
trap 'stopping=1' TERM INT
trap ':' HUP

record() {
  printf '%s\n' "$2" >"$folder/.$1" && mv -f "$folder/.$1" "$folder/$1"
}

record pid "$$"
# shellcheck source=/dev/null
. "$folder/env"
export MJ_PREEMPTION_NOTICE_FILE="$folder/preemption-notice" PYTHONUNBUFFERED=1
cd "$folder/workdir" || exit 1

if [ -s "$folder/setup.sh" ]; then
  record phase SETTING_UP
  bash "$folder/setup.sh" >>"$log" 2>&1 </dev/null
  code=$?
  record setup_exit "$code"
  [ "$stopping" = 1 ] && exit 0
  if [ "$code" != 0 ]; then
    record end_time "$(date +%s.%N)"
    record phase FAILED_SETUP
    exit 0
  fi
fi
record phase RUNNING
code=0
if [ -s "$folder/run.sh" ]; then
  bash "$folder/run.sh" >>"$log" 2>&1 </dev/null
  code=$?
fi
record run_exit "$code"
[ "$stopping" = 1 ] && exit 0
record end_time "$(date +%s.%N)"
if [ "$code" = 0 ]; then record phase SUCCEEDED; else record phase FAILED; fi
