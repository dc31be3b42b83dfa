#!/usr/bin/env bash
# run.sh - benchmark roost's content-addressed home store against restic and borg,
# side by side on the same generated "agent home" (bench/gen_home.py).
#
# Phases (each tool in turn, everything warm in the page cache):
#   push-initial    first push into an empty repo
#   push-unchanged  push again, nothing changed
#   push-mutated    push after gen_home.py --mutate 1
#   pull-empty      restore the latest state into an empty directory
#   pull-over-prev  restore the latest state over the tool's own earlier restore
#                   of the pre-mutation home (the "wake on the same host" case)
# Wall time and peak RSS come from /usr/bin/time -f '%e %M'.  Every restore is
# verified against the source with bench/manifest.py (not timed).
# Prints a markdown report and saves it to bench/results/<date>.md.
#
# Usage: bench/run.sh [--quick] [--files N] [--size 2G] [--seed S] [--keep]
#   --quick          small run: 2000 files / 100M
#   --keep           keep $BENCH_DIR afterwards (default: delete the data)
#   env ROOST_BIN    roost binary (default: target/release/roost of this checkout)
#   env BENCH_DIR    scratch dir, wiped at start (default /tmp/roost-bench)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOST_BIN=${ROOST_BIN:-$HERE/../target/release/roost}
BENCH_DIR=${BENCH_DIR:-/tmp/roost-bench}
FILES=100000 SIZE=2G SEED=1 KEEP= LABEL=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) FILES=2000 SIZE=100M LABEL=-quick ;;
    --files) FILES=$2; shift ;;
    --size)  SIZE=$2; shift ;;
    --seed)  SEED=$2; shift ;;
    --keep)  KEEP=1 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

for t in restic borg /usr/bin/time python3; do
  command -v "$t" >/dev/null || { echo "run.sh: missing $t (apt-get install -y restic borgbackup time)" >&2; exit 1; }
done
HAVE_ROOST=; [ -x "$ROOST_BIN" ] && HAVE_ROOST=1
TOOLS="roost restic borg"
PHASES="push-initial push-unchanged push-mutated pull-empty pull-over-prev"

# --- scratch layout (wiped only if it is ours) -------------------------------
if [ -e "$BENCH_DIR" ] && [ ! -e "$BENCH_DIR/.roost-bench" ] && [ -n "$(ls -A "$BENCH_DIR")" ]; then
  echo "run.sh: $BENCH_DIR exists and was not made by run.sh; refusing to wipe it" >&2; exit 1
fi
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR" && touch "$BENCH_DIR/.roost-bench"
SRC=$BENCH_DIR/src            # the home being pushed
OUT=$BENCH_DIR/out            # restore targets
LOGS=$BENCH_DIR/logs          # stdout/stderr/time of every command
RES=$BENCH_DIR/res            # one small file per measurement
mkdir -p "$OUT" "$LOGS" "$RES"

export RESTIC_REPOSITORY=$BENCH_DIR/restic-repo RESTIC_PASSWORD=bench RESTIC_CACHE_DIR=$BENCH_DIR/restic-cache
# The peers save everything, so roost does too (its default skips pip caches etc.).
export ROOST_STATE_DIR=$BENCH_DIR/roost-state ROOST_HOME_EXCLUDES=
export BORG_REPO=$BENCH_DIR/borg-repo BORG_BASE_DIR=$BENCH_DIR/borg-base
export BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes BORG_RELOCATED_REPO_ACCESS_IS_OK=yes
# restic >= 0.17 can skip unchanged files when restoring over a tree; older versions rewrite everything
RESTIC_OVERWRITE=(); restic restore --help | grep -- '--overwrite' >/dev/null && RESTIC_OVERWRITE=(--overwrite if-changed)
ROOST_ARGS=(--store "$BENCH_DIR/roost-store" --org bench --home h1 --json)

log() { echo "[$(date +%T)] $*" >&2; }

# run_timed TOOL PHASE DIR CMD... : run CMD in DIR under /usr/bin/time and
# store "seconds rss_kb rc" in $RES/TOOL.PHASE; output goes to $LOGS.
run_timed() {
  local tool=$1 phase=$2 dir=$3 rc=0; shift 3
  local log=$LOGS/$tool.$phase
  log "  $tool: $*"
  (cd "$dir" && /usr/bin/time -f '%e %M' -o "$log.time" "$@" >"$log.out" 2>"$log.err") || rc=$?
  echo "$(tail -n1 "$log.time") $rc" >"$RES/$tool.$phase"
  if [ "$rc" != 0 ]; then
    log "!!! $tool $phase exited with status $rc; last lines of $log.err:"
    tail -n5 "$log.err" | sed 's/^/      /' >&2
  fi
}

push() {  # push TOOL PHASE
  case $1 in
    roost)  [ -n "$HAVE_ROOST" ] && run_timed roost "$2" "$SRC" "$ROOST_BIN" home push "$SRC" "${ROOST_ARGS[@]}" ;;
    restic) run_timed restic "$2" "$SRC" restic backup . ;;
    borg)   run_timed borg "$2" "$SRC" borg create --compression lz4 "::$2" . ;;
  esac
  return 0
}

pull() {  # pull TOOL PHASE DEST [BORG_ARCHIVE]: restore the latest push
  case $1 in
    roost)  [ -n "$HAVE_ROOST" ] && run_timed roost "$2" "$3" "$ROOST_BIN" home pull "$3" "${ROOST_ARGS[@]}" ;;
    restic) run_timed restic "$2" "$3" restic restore latest --target "$3" "${RESTIC_OVERWRITE[@]}" ;;
    borg)   run_timed borg "$2" "$3" borg extract "::${4:-push-mutated}" ;;
  esac
  return 0
}

verify() {  # verify TOOL PHASE DEST : compare DEST with the current source (untimed)
  [ -e "$RES/$1.$2" ] || return 0
  python3 "$HERE/manifest.py" "$3" >"$LOGS/$1.$2.manifest"
  if cmp -s "$LOGS/$1.$2.manifest" "$BENCH_DIR/manifest-src.txt"; then
    echo ok >"$RES/$1.$2.verify"
    log "  $1 $2: restored tree verified identical to source"
  else
    echo MISMATCH >"$RES/$1.$2.verify"
    log "!!!!!! $1 $2: RESTORED TREE DIFFERS FROM SOURCE (first differences, < source > restored):"
    diff "$BENCH_DIR/manifest-src.txt" "$LOGS/$1.$2.manifest" | head -n 10 | sed 's/^/      /' >&2 || true
  fi
}

# --- setup (untimed) -----------------------------------------------------------
log "generating home: --files $FILES --size $SIZE --seed $SEED"
GEN_SUMMARY=$(python3 "$HERE/gen_home.py" "$SRC" --files "$FILES" --size "$SIZE" --seed "$SEED")
log "$GEN_SUMMARY"
sync  # untimed: no tool should pay for flushing the generator's writes
restic init --repository-version 2 >"$LOGS/restic.init" 2>&1
borg init --encryption=none >"$LOGS/borg.init" 2>&1
[ -n "$HAVE_ROOST" ] || log "roost: not built ($ROOST_BIN missing); running peers only"

# --- phases --------------------------------------------------------------------
for phase in push-initial push-unchanged; do
  log "phase $phase"
  for t in $TOOLS; do push "$t" "$phase"; done
done

# Untimed: each tool restores the pre-mutation home; pull-over-prev updates it.
log "preparing earlier restores for pull-over-prev"
for t in $TOOLS; do
  mkdir -p "$OUT/$t-prev"
  pull "$t" prep-prev "$OUT/$t-prev" push-unchanged
done

MUTATE_SUMMARY=$(python3 "$HERE/gen_home.py" "$SRC" --mutate 1 --seed "$SEED")
log "$MUTATE_SUMMARY"
sync
log "phase push-mutated"
for t in $TOOLS; do push "$t" push-mutated; done
python3 "$HERE/manifest.py" "$SRC" >"$BENCH_DIR/manifest-src.txt"

log "phase pull-empty"
for t in $TOOLS; do
  mkdir -p "$OUT/$t-empty"
  pull "$t" pull-empty "$OUT/$t-empty"
  verify "$t" pull-empty "$OUT/$t-empty"
  rm -rf "$OUT/$t-empty"
done

log "phase pull-over-prev"
for t in $TOOLS; do
  pull "$t" pull-over-prev "$OUT/$t-prev"
  verify "$t" pull-over-prev "$OUT/$t-prev"
  rm -rf "$OUT/$t-prev"
done

# --- report --------------------------------------------------------------------
# cell TOOL PHASE FIELD(1=secs 2=rss): number or "-"
num() { [ -e "$RES/$1.$2" ] && awk -v f="$3" '{print $f}' "$RES/$1.$2" || echo -; }
# show TOOL PHASE FIELD: formatted cell (time cells carry rc / verification flags)
show() {
  if [ "$1" = roost ] && [ -z "$HAVE_ROOST" ]; then echo "roost: not built"; return; fi
  [ -e "$RES/$1.$2" ] || { echo "-"; return; }
  local v rc flag=
  v=$(num "$1" "$2" "$3"); rc=$(awk '{print $3}' "$RES/$1.$2")
  if [ "$3" = 2 ]; then awk -v v="$v" 'BEGIN{printf "%.1f\n", v/1024}'; return; fi
  [ "$rc" != 0 ] && flag=" (rc=$rc)"
  [ -e "$RES/$1.$2.verify" ] && [ "$(cat "$RES/$1.$2.verify")" != ok ] && flag="$flag **MISMATCH**"
  echo "$v$flag"
}
# ratio PHASE FIELD: roost / min(restic, borg)
ratio() {
  awk -v r="$(num roost "$1" "$2")" -v a="$(num restic "$1" "$2")" -v b="$(num borg "$1" "$2")" 'BEGIN{
    best = (a == "-") ? b : (b == "-" || a + 0 < b + 0) ? a : b
    if (r == "-" || best == "-" || best + 0 == 0) print "-"; else printf "%.2f\n", r / best }'
}

DATE=$(date +%Y-%m-%d_%H%M)
mkdir -p "$HERE/results"
REPORT=$HERE/results/$DATE$LABEL.md
ROOST_VERSION=$([ -n "$HAVE_ROOST" ] && "$ROOST_BIN" --version 2>/dev/null || echo "not built")
{
  echo "# roost vs restic vs borg ($DATE$LABEL)"
  echo
  echo "- data: \`gen_home.py --files $FILES --size $SIZE --seed $SEED\`: ${GEN_SUMMARY#gen_home: }"
  echo "- mutation before push-mutated: ${MUTATE_SUMMARY#gen_home: }"
  echo "- versions: roost: $ROOST_VERSION; $(restic version | cut -d' ' -f1-2); $(borg --version); python $(python3 -c 'import platform; print(platform.python_version())')"
  echo "- machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, $(uname -sr); load avg at end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- everything runs warm (page cache not dropped); local repos under \`$BENCH_DIR\`"
  echo "- restic: always encrypted (RESTIC_PASSWORD), repo format v2, compression auto;" \
       "borg: \`--encryption=none\`, \`--compression lz4\`; roost: defaults"
  echo "- time = wall seconds, RSS = peak resident MiB (\`/usr/bin/time -f '%e %M'\`); ratio = roost / best peer (< 1 means roost wins)"
  echo
  echo "| phase | roost s | restic s | borg s | roost/best s | roost RSS | restic RSS | borg RSS | roost/best RSS |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for p in $PHASES; do
    echo "| $p | $(show roost "$p" 1) | $(show restic "$p" 1) | $(show borg "$p" 1) | $(ratio "$p" 1)" \
         "| $(show roost "$p" 2) | $(show restic "$p" 2) | $(show borg "$p" 2) | $(ratio "$p" 2) |"
  done
  echo
  echo "Repository size after the three pushes (source: $(du -sh "$SRC" | cut -f1)):" \
       "roost $([ -d "$BENCH_DIR/roost-store" ] && du -sh "$BENCH_DIR/roost-store" | cut -f1 || echo -)," \
       "restic $(du -sh "$RESTIC_REPOSITORY" | cut -f1), borg $(du -sh "$BORG_REPO" | cut -f1)"
  if [ -n "$HAVE_ROOST" ]; then
    echo
    echo "roost push JSON:"
    echo
    for p in push-initial push-unchanged push-mutated; do
      echo "- $p: \`$(tr -d '\n' <"$LOGS/roost.$p.out")\`"
    done
  fi
  echo
  echo "Notes:"
  if [ ${#RESTIC_OVERWRITE[@]} -gt 0 ]; then
    echo "- pull-over-prev: restic uses \`restore --overwrite if-changed\`; borg extract replaces every file."
  else
    echo "- pull-over-prev: restic $(restic version | cut -d' ' -f2) has no \`restore --overwrite\` (added in 0.17):" \
         "it rewrites every file and reports an error for each already-existing symlink (hence rc=1; the tree" \
         "still verifies because the symlinks did not change); borg extract replaces every file."
  fi
  echo "- restore verification (manifest of type/mode/size/sha256/link target):$(cd "$RES" && for f in *.verify; do
      [ -e "$f" ] && printf ' %s %s;' "${f%.verify}" "$(cat "$f")"; done)"
  echo "- rc=N: the command exited non-zero (see $LOGS); **MISMATCH**: restored tree differs from the source."
} >"$REPORT"
cat "$REPORT"
log "report saved to $REPORT"

if [ -z "$KEEP" ]; then rm -rf "$BENCH_DIR"; else log "kept $BENCH_DIR"; fi
