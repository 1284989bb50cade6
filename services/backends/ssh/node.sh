#!/usr/bin/env bash
# What the ssh backend runs on a host of a node pool. Every SSH command is
#     bash -c "<this script>" node.sh VERB ARGS...
# so hosts need nothing installed but bash, coreutils and util-linux (flock, setsid),
# and every controller replica speaks the same protocol it ships.
#
# State lives under ~/.mj of the pool's user on the host (the module docstring of
# services/backends/ssh describes it):
#   reservation/owner      the cluster holding this host: key=value lines
#   reservation/ready      the rank was started (the cluster is past launching)
#   clusters/NAME.LAUNCH/  one launch's folder: env, setup.sh, run.sh, runner.sh,
#                          pid, phase, setup_exit, run_exit, end_time, logs/, workdir/
#   fence/job-JOB          the highest epoch ever reserved here for the job
#   fence/cluster-NAME     "EPOCH STARTED LAUNCH" of the newest launch of the name here
#   lock                   flock: reservations and releases happen one at a time
# A reply follows the line "@mj-reply": lines of a word and key=value fields (values
# never hold spaces), and for `logs`, the log bytes after the first of them.
set -u
umask 077
MJ_HOME="$HOME/.mj"
RES="$MJ_HOME/reservation"
CLUSTERS="$MJ_HOME/clusters"
FENCE="$MJ_HOME/fence"
mkdir -p "$CLUSTERS" "$FENCE" || exit 3

# Runs "$@" holding the host's lock.
locked() {
  (
    flock -w 20 9 || { echo "error what=lock"; exit 75; }
    "$@"
  ) 9>>"$MJ_HOME/lock"
}

# Replaces file $1 with the text $2 so that readers see the old or the new text.
put() {
  printf '%s\n' "$2" >"$1.tmp.$$" && mv -f "$1.tmp.$$" "$1"
}

# The first line of file $1, or $2 when it is missing.
get() {
  local value=
  IFS= read -r value 2>/dev/null <"$1"
  printf '%s' "${value:-${2-}}"
}

# Sets o_* from the reservation's owner file; fails when the host is free.
read_owner() {
  o_cluster='' o_job=0 o_epoch=0 o_launch='' o_rank=0 o_reserved_at=0
  [ -e "$RES" ] || return 1
  local key value
  while IFS='=' read -r key value; do
    case "$key" in
      cluster) o_cluster=$value ;;
      job) o_job=$value ;;
      epoch) o_epoch=$value ;;
      launch) o_launch=$value ;;
      rank) o_rank=$value ;;
      reserved_at) o_reserved_at=$value ;;
    esac
  done <"$RES/owner" 2>/dev/null
  return 0
}

folder_of() { printf '%s' "$CLUSTERS/$1.$2"; }

# Whether the runner whose pid is in folder $1 is alive (a reused pid does not count).
runner_alive() {
  local pid stat
  pid=$(get "$1/pid")
  [ -n "$pid" ] || return 1
  stat=$(get "/proc/$pid/stat")
  case "${stat##*) }" in "" | Z* | X*) return 1 ;; esac
  tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qxF "$1/runner.sh"
}

# Pids of this user's processes whose environment holds the line $1 (KEY=value).
tagged() {
  grep -lzxF -- "$1" /proc/[0-9]*/environ 2>/dev/null | while IFS=/ read -r _ _ pid _; do
    [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] && printf '%s\n' "$pid"
  done
}

# Sends signal $2 to folder $1's runner's process group (while the runner lives: a
# dead runner's pid may be reused) and to every process tagged with the folder.
signal_folder() {
  runner_alive "$1" && kill "-$2" -- "-$(get "$1/pid")" 2>/dev/null
  tagged "MJ_CLUSTER_DIR=$1" | xargs -r kill "-$2" 2>/dev/null
  return 0
}

# Whether anything of folder $1 still runs (zombies do not count: their environment
# reads empty).
folder_running() {
  runner_alive "$1" || [ -n "$(tagged "MJ_CLUSTER_DIR=$1")" ]
}

kill_folder() {
  signal_folder "$1" KILL
}

# Moves $1 into the trash: a rename, instant even for a large workdir, so it can be
# done holding the lock; `empty_trash` deletes it once the lock is released.
to_trash() {
  [ -e "$1" ] && mv -T "$1" "$MJ_HOME/.trash.$$.$RANDOM$RANDOM" 2>/dev/null
  return 0
}

empty_trash() {
  rm -rf "$MJ_HOME"/.trash.* 2>/dev/null
  return 0
}

# Releases the host (the reservation goes first) and discards folder $1.
drop_reservation() {
  to_trash "$RES"
  to_trash "$1"
}

reservation_line() {
  if read_owner; then
    local fields now ready=0
    fields=$(tr '\n' ' ' <"$RES/owner" 2>/dev/null)
    now=$(date +%s)
    [ -e "$RES/ready" ] && ready=1
    echo "reservation ${fields}ready=$ready age=$((now - ${o_reserved_at:-0}))"
  else
    echo "free"
  fi
}

# reserve NAME JOB TASK EPOCH LAUNCH STARTED POOL: takes this host for a launch.
do_reserve() {
  local name=$1 job=$2 task=$3 epoch=$4 launch=$5 started=$6 pool=$7
  local fence tmp newest_epoch newest_started
  fence=$(get "$FENCE/job-$job" 0)
  if ((epoch < fence)); then echo "stale epoch=$fence"; return; fi
  if read_owner; then
    if [ "$o_cluster" = "$name" ] && ((o_epoch > epoch)); then
      echo "stale epoch=$o_epoch"
    else
      echo "busy cluster=${o_cluster:-unknown}"
    fi
    return
  fi
  tmp="$MJ_HOME/.new.$launch"
  rm -rf "$tmp"
  mkdir -p "$tmp" "$(folder_of "$name" "$launch")/logs" || { echo "error what=mkdir"; return; }
  printf 'cluster=%s\njob=%s\ntask=%s\nepoch=%s\nlaunch=%s\nstarted=%s\npool=%s\nreserved_at=%s\n' \
    "$name" "$job" "$task" "$epoch" "$launch" "$started" "$pool" "$(date +%s)" >"$tmp/owner"
  # rename(2) onto a name that exists fails, so two launches can never both take the host.
  if ! mv -T "$tmp" "$RES" 2>/dev/null; then
    rm -rf "$tmp"
    echo "busy cluster=unknown"
    return
  fi
  ((epoch > fence)) && put "$FENCE/job-$job" "$epoch"
  read -r newest_epoch newest_started _ <<<"$(get "$FENCE/cluster-$name" "0 0 -")"
  if ((epoch > newest_epoch || (epoch == newest_epoch && started > newest_started))); then
    put "$FENCE/cluster-$name" "$epoch $started $launch"
  fi
  echo "ok"
}

# start NAME LAUNCH RANK NODES HOSTS, with four base64 lines on stdin (env, setup,
# run, runner): writes the rank's files and starts its runner in a session of its own.
start_locked() {
  local name=$1 launch=$2 rank=$3 nodes=$4 hosts=$5 folder file line
  if ! read_owner || [ "$o_launch" != "$launch" ]; then echo "gone"; return 1; fi
  folder=$(folder_of "$name" "$launch")
  mkdir -p "$folder/workdir" "$folder/logs" || { echo "error what=mkdir"; return 1; }
  for file in env setup.sh run.sh runner.sh; do
    IFS= read -r line || { echo "error what=stdin"; return 1; }
    printf '%s' "$line" | base64 -d >"$folder/$file" || { echo "error what=write"; return 1; }
  done
  if ! { cat "$RES/owner" && printf 'rank=%s\nnodes=%s\nhosts=%s\n' "$rank" "$nodes" "$hosts"; } \
    >"$RES/.owner" || ! mv -f "$RES/.owner" "$RES/owner"; then
    echo "error what=owner"
    return 1
  fi
  # 9>&-: the runner must not inherit the lock (it would hold it as long as it runs).
  (cd "$folder" && MJ_CLUSTER_DIR="$folder" MJ_CLUSTER_NAME="$name" \
    setsid -f bash "$folder/runner.sh" "$rank" </dev/null >>"$folder/runner.log" 2>&1 9>&-) ||
    { echo "error what=setsid"; return 1; }
}

mark_ready() {
  if ! read_owner || [ "$o_launch" != "$1" ]; then echo "gone"; return 1; fi
  : >"$RES/ready"
}

do_start() {
  local folder i
  locked start_locked "$@" || return
  folder=$(folder_of "$1" "$2")
  for ((i = 0; i < 200; i++)); do
    [ -s "$folder/pid" ] && break
    sleep 0.05
  done
  [ -s "$folder/pid" ] || { echo "error what=runner-did-not-start"; return; }
  locked mark_ready "$2" || return
  echo "ok pid=$(get "$folder/pid")"
}

# One line about launch $2 of cluster $1 as this host sees it.
cluster_line() {
  local name=$1 launch=$2 folder ready=0 alive=0
  if ! read_owner || [ "$o_launch" != "$launch" ]; then
    echo "cluster name=$name launch=$launch state=absent"
    return
  fi
  folder=$(folder_of "$name" "$launch")
  [ -e "$RES/ready" ] && ready=1
  runner_alive "$folder" && alive=1
  echo "cluster name=$name launch=$launch state=ours rank=$o_rank ready=$ready alive=$alive" \
    "age=$(($(date +%s) - ${o_reserved_at:-0}))" \
    "phase=$(get "$folder/phase" PENDING) setup_exit=$(get "$folder/setup_exit" -)" \
    "run_exit=$(get "$folder/run_exit" -) end_time=$(get "$folder/end_time" -)"
}

# observe NAME LAUNCH [NAME LAUNCH]...
do_observe() {
  while (($# >= 2)); do
    cluster_line "$1" "$2"
    shift 2
  done
}

# scan JOB CHECK_PROCESSES NAME...: the reservation, the cluster folders, and for
# each NAME its newest launch here (and with CHECK_PROCESSES, its processes).
do_scan() {
  local job=$1 procs=$2 entry name epoch started launch
  shift 2
  reservation_line
  for entry in "$CLUSTERS"/*; do
    [ -d "$entry" ] && echo "folder name=${entry##*/}"
  done
  [ "$job" != 0 ] && echo "job job=$job epoch=$(get "$FENCE/job-$job" 0)"
  for name in "$@"; do
    read -r epoch started launch <<<"$(get "$FENCE/cluster-$name" "0 0 -")"
    echo "fence name=$name epoch=$epoch started=$started launch=$launch"
    if [ "$procs" = 1 ]; then
      echo "tagged name=$name count=$(tagged "MJ_CLUSTER_NAME=$name" | wc -l)"
    fi
  done
}

# Decides, under the lock, what `terminate` stops: prints "target LAUNCH" or why not.
terminate_check() {
  local name=$1 epoch=$2
  if ! read_owner || [ "$o_cluster" != "$name" ]; then echo "target -"; return; fi
  if ((epoch > 0 && (o_epoch > epoch || $(get "$FENCE/job-$o_job" 0) > epoch))); then
    echo "stale epoch=$o_epoch"
    return
  fi
  echo "target $o_launch"
}

terminate_finish() {
  local name=$1 launch=$2 keep='' folder
  tagged "MJ_CLUSTER_NAME=$name" | xargs -r kill -KILL 2>/dev/null
  if read_owner && [ "$o_cluster" = "$name" ] && [ "$o_launch" = "$launch" ]; then
    kill_folder "$(folder_of "$name" "$launch")"
    drop_reservation "$(folder_of "$name" "$launch")"
  elif read_owner; then
    keep=$(folder_of "$o_cluster" "$o_launch")
  fi
  for folder in "$CLUSTERS/$name".*; do
    [ -d "$folder" ] && [ "$folder" != "$keep" ] && kill_folder "$folder" && to_trash "$folder"
  done
  return 0
}

# SIGTERM to everything of folder $1, SIGKILL to what is left after $2 tenths of a second.
stop_folder() {
  local folder=$1 tenths=$2 i
  signal_folder "$folder" TERM
  for ((i = 0; i < tenths; i++)); do
    folder_running "$folder" || break
    sleep 0.1
  done
  kill_folder "$folder"
}

# terminate NAME EPOCH GRACE_TENTHS: SIGTERM, SIGKILL after the grace, then removes
# every launch of NAME here and releases the host if NAME holds it.
do_terminate() {
  local name=$1 epoch=$2 tenths=$3 reply word launch
  reply=$(locked terminate_check "$name" "$epoch")
  read -r word launch <<<"$reply"
  if [ "$word" != target ]; then echo "$reply"; return; fi
  [ "$launch" != - ] && stop_folder "$(folder_of "$name" "$launch")" "$tenths"
  locked terminate_finish "$name" "$launch"
  if [ "$launch" = - ]; then echo "absent"; else echo "ok"; fi
  empty_trash
}

# release LAUNCH: kills and removes that launch if it still holds the host.
release_locked() {
  if read_owner && [ "$o_launch" = "$1" ]; then
    local folder
    folder=$(folder_of "$o_cluster" "$o_launch")
    kill_folder "$folder"
    drop_reservation "$folder"
    echo "ok"
  else
    echo "absent"
  fi
}

# Whether launch $1 holds the host and epoch $2 may act on it: prints "ok" or why not.
launch_check() {
  local launch=$1 epoch=$2
  if ! read_owner || [ "$o_launch" != "$launch" ]; then echo "absent"; return; fi
  if ((epoch > 0 && (o_epoch > epoch || $(get "$FENCE/job-$o_job" 0) > epoch))); then
    echo "stale epoch=$o_epoch"
    return
  fi
  echo "ok"
}

# notify NAME LAUNCH EPOCH DEADLINE: the preemption notice file, then SIGTERM.
notify_locked() {
  local reply folder
  reply=$(launch_check "$2" "$3")
  if [ "$reply" != ok ]; then echo "$reply"; return; fi
  folder=$(folder_of "$1" "$2")
  put "$folder/preemption-notice" "$4"
  signal_folder "$folder" TERM
  echo "ok"
}

# stop NAME LAUNCH EPOCH GRACE_TENTHS: SIGTERM, SIGKILL after the grace; the folder,
# its logs and the reservation stay until `terminate`.
do_stop() {
  local reply
  reply=$(locked launch_check "$2" "$3")
  if [ "$reply" != ok ]; then echo "$reply"; return; fi
  stop_folder "$(folder_of "$1" "$2")" "$4"
  echo "ok"
}

# gc: removes folders no reservation owns (a release that stopped half-way), with
# their processes, and fence records nobody touched for 30 days.
gc_locked() {
  local keep='' folder
  read_owner && keep=$(folder_of "$o_cluster" "$o_launch")
  for folder in "$CLUSTERS"/*; do
    [ -d "$folder" ] && [ "$folder" != "$keep" ] && kill_folder "$folder" && to_trash "$folder"
  done
  find "$MJ_HOME" -maxdepth 1 -name '.new.*' -mmin +60 -exec rm -rf {} + 2>/dev/null
  find "$FENCE" -type f -mtime +30 -delete 2>/dev/null
  return 0
}

# logs NAME LAUNCH OFFSET LIMIT: a header line, then up to LIMIT bytes of the rank's
# log from OFFSET. The header is read first, so bytes written before a finish it
# reports are in this reply or the next.
do_logs() {
  local name=$1 launch=$2 offset=$3 limit=$4 folder log ended=0 alive=0 ready=0
  if ! read_owner || [ "$o_launch" != "$launch" ]; then
    echo "logs state=absent"
    return
  fi
  folder=$(folder_of "$name" "$launch")
  log="$folder/logs/rank-$o_rank.log"
  [ -e "$RES/ready" ] && ready=1
  [ -e "$folder/end_time" ] && ended=1
  runner_alive "$folder" && alive=1
  echo "logs state=ours rank=$o_rank ready=$ready ended=$ended alive=$alive"
  [ -e "$log" ] && tail -c "+$((offset + 1))" "$log" | head -c "$limit"
  return 0
}

verb=${1-}
shift || true
# Whatever the user's shell startup files printed ends here: the reply follows.
echo "@mj-reply"
case "$verb" in
  reserve) locked do_reserve "$@" ;;
  start) do_start "$@" ;;
  observe) do_observe "$@" ;;
  scan) do_scan "$@" ;;
  reapscan) locked gc_locked && do_scan 0 0 && empty_trash ;;
  terminate) do_terminate "$@" ;;
  release) locked release_locked "$@" && empty_trash ;;
  notify) locked notify_locked "$@" ;;
  stop) do_stop "$@" ;;
  logs) do_logs "$@" ;;
  ping) echo "pong" ;;
  *) echo "error what=unknown-verb"; exit 2 ;;
esac
