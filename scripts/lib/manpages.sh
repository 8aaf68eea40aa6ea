# SPDX-License-Identifier: Apache-2.0
# Shared by scripts/dist.sh and scripts/deb.sh: the man pages and shell completions of udp-fanout,
# collector and publisher, made from the release binaries each time (nothing generated is committed).
#
# Man pages: swift-argument-parser's generate-manual tool (the tool behind its `generate-manual`
# command plugin) reads `<program> --experimental-dump-help` and writes mdoc. The plugin itself is
# not used to write the pages: it first builds every product of the package again (a whole
# second build, in a configuration without --static-swift-stdlib, over the release build's
# outputs). `swift package plugin generate-manual --help` only builds the plugin's tool and prints
# its help, so that is how the tool is built (once; later runs find it up to date), and the tool
# then runs on the release binaries. MANPAGE_TOOL=<path> uses an already built generate-manual.
#
# Completions: each program's own `--generate-completion-script bash|zsh|fish`.
#
# Functions fail loudly (a message naming what failed, then exit 1).

PROGRAMS="udp-fanout collector publisher"

# manpage_tool: prints the path of swift-argument-parser's generate-manual tool, building it first.
manpage_tool() {
  if [ -n "${MANPAGE_TOOL:-}" ]; then
    [ -x "$MANPAGE_TOOL" ] || { echo "manpages: MANPAGE_TOOL=$MANPAGE_TOOL is not an executable" >&2; exit 1; }
    echo "$MANPAGE_TOOL"
    return 0
  fi
  local log bindir candidate
  log=$(mktemp)
  # --help: the plugin builds its tool, prints the tool's help and returns before building the package.
  if ! PATH="/opt/swift/usr/bin:$PATH" swift package plugin generate-manual --help >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "manpages: building swift-argument-parser's generate-manual tool failed (output above)" >&2
    exit 1
  fi
  rm -f "$log"
  bindir=$(PATH="/opt/swift/usr/bin:$PATH" swift build --show-bin-path)
  # SwiftPM names a plugin's host tool <name>-tool (6.x); older versions used the plain name.
  for candidate in "$bindir/generate-manual-tool" "$bindir/generate-manual"; do
    if [ -x "$candidate" ]; then echo "$candidate"; return 0; fi
  done
  echo "manpages: the generate-manual plugin ran, but its tool is not in $bindir" >&2
  exit 1
}

# manpage_date: the pages' date, from SOURCE_DATE_EPOCH or the last commit (reproducible), else today.
manpage_date() {
  if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
    date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d
  else
    git log -1 --format=%cd --date=format:%Y-%m-%d 2>/dev/null || date -u +%Y-%m-%d
  fi
}

# write_manpages TOOL BIN_DIR MAN1_DIR: MAN1_DIR/<program>.1.gz for each program (gzip -9n).
write_manpages() {
  local tool=$1 bin=$2 out=$3 day program
  day=$(manpage_date)
  mkdir -p "$out"
  for program in $PROGRAMS; do
    rm -f "$out/$program.1" "$out/$program.1.gz"
    if ! "$tool" "$bin/$program" --date "$day" --section 1 --output-directory "$out" >/dev/null; then
      echo "manpages: generate-manual failed on $bin/$program" >&2
      exit 1
    fi
    [ -s "$out/$program.1" ] || { echo "manpages: generate-manual wrote no $out/$program.1" >&2; exit 1; }
    gzip -9n "$out/$program.1"
  done
}

# write_completions BIN_DIR BASH_DIR ZSH_DIR FISH_DIR: BASH_DIR/<program>, ZSH_DIR/_<program>,
# FISH_DIR/<program>.fish for each program.
write_completions() {
  local bin=$1 bash_dir=$2 zsh_dir=$3 fish_dir=$4 program shell file
  mkdir -p "$bash_dir" "$zsh_dir" "$fish_dir"
  for program in $PROGRAMS; do
    for shell in bash zsh fish; do
      case $shell in
        bash) file="$bash_dir/$program" ;;
        zsh) file="$zsh_dir/_$program" ;;
        fish) file="$fish_dir/$program.fish" ;;
      esac
      if ! "$bin/$program" --generate-completion-script "$shell" >"$file.tmp" || [ ! -s "$file.tmp" ]; then
        echo "manpages: $bin/$program --generate-completion-script $shell failed" >&2
        exit 1
      fi
      # Completions are sourced, not run: bash's #!/bin/bash line goes (lintian: bash-completion-with-hashbang).
      sed '1{/^#!/d}' "$file.tmp" >"$file"
      rm -f "$file.tmp"
    done
  done
}
