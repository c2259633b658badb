#!/bin/sh
# tools/api-doc.sh [--check] [ROOT]: the C API reference, generated from
# the public headers (a library folder's *.h but *_impl.h: what `make
# install` installs), floor by floor from core/ up: docs/API.md (the
# floors, their headers, how to build against them) and one page per
# floor, docs/api/<floor>.md: for each header its opening sentence, then
# every function it declares on one line, with the comment written above
# it in the header (its contract; a comment above several declarations in
# a row covers them all and is shown once with all of their prototypes; a
# function right after a type it fills takes the type's comment; a
# comment after the declaration on its line is shown after it). `make
# api-doc` runs it.
#
# --check: prints the public functions that docs/API.md's pages do not
# name, and the ones they name that no public header declares any more,
# and exits 1 if there is either (tests/test_api_doc.c; `make api-doc`
# brings the pages up to date). Comments changed since the pages were
# written do not fail it.
set -eu
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
# the floors, bottom up (tools/check-layers.sh has the same list)
floors='core shm cuda mpi models dist rpc dp ddp fsdp pp tp ps'
headers=$(cd "$root" && for d in $floors; do
            [ -d "$d" ] || continue
            for h in "$d"/*.h; do case $h in *_impl.h) ;; *) [ -e "$h" ] && echo "$h";; esac; done
          done)
[ -n "$headers" ] || { echo "api-doc: no public headers under $root" >&2; exit 2; }

# shellcheck disable=SC2086 # $headers: folder/file.h names
gen() { (cd "$root" && awk '
function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
function md(s) {             # contract text as Markdown: no emphasis, no tags
    gsub(/[ \t]+/, " ", s)
    gsub(/\\/, "\\\\", s); gsub(/\*/, "\\*", s); gsub(/</, "\\&lt;", s)
    return s
}
function first_sentence(s,   i) {
    gsub(/[ \t]+/, " ", s)
    sub(/^[^ ]+: /, "", s)   # "core/device.h: the device ..." -> "the device ..."
    i = match(s, /(\.|:) (- |$)|\.( |$)/)   # up to a full stop, or a list
    if (i) s = substr(s, 1, i - 1) "."
    if (s !~ /^[^ ]*\//) s = toupper(substr(s, 1, 1)) substr(s, 2)   # not a path
    return md(s)
}
function uncomment(s,   rest, e) {   # the code of a line, comments removed
    while (match(s, /\/\*/)) {
        rest = substr(s, RSTART + 2); e = index(rest, "*/")
        if (!e) return substr(s, 1, RSTART - 1)
        s = substr(s, 1, RSTART - 1) " " substr(rest, e + 2)
    }
    return s
}
function proto(s) {          # one declaration, as shown
    gsub(/[ \t]+/, " ", s)
    gsub(/__attribute__\(\((\([^()]*\)|[^()])*\)\)/, "", s)
    sub(/[ \t]*\{.*$/, "", s); sub(/;.*$/, "", s)
    sub(/^ *static inline (TDM_HD )?/, "static inline ", s)
    gsub(/ +/, " ", s); gsub(/\( /, "(", s); gsub(/ \)/, ")", s); gsub(/ ,/, ",", s)
    return trim(s)
}
function trailing(s,   t) {  # "f(...); /* NULL ok */" -> "NULL ok"
    if (!match(s, /;[ \t]*\/\*.*\*\//)) return ""
    t = substr(s, RSTART, RLENGTH); sub(/^;[ \t]*\/\*+[ \t]*/, "", t); sub(/[ \t]*\*\/$/, "", t)
    return t
}
function section(c,   t) {   # "--- gemm --- rest" -> prints "### gemm", returns "rest"
    if (c !~ /^[ \t]*---+ /) return c
    t = c; sub(/^[ \t]*---+[ \t]*/, "", t)
    if (match(t, /[ \t]*---+/)) { title = substr(t, 1, RSTART - 1); c = substr(t, RSTART + RLENGTH) }
    else { title = t; c = "" }
    flush()
    printf "\n### %s\n\n", trim(title)
    return c
}
function flush(   i, line, c) {   # the pending group: its prototypes and contract
    if (ng == 0) return
    line = "- "
    for (i = 1; i <= ng; i++)
        line = line (i > 1 ? ", " : "") "`" group[i] "`" (gtrail[i] != "" ? " (" md(gtrail[i]) ")" : "")
    c = trim(gcomment)
    print line (c != "" ? ": " md(c) : "")
    ng = 0; gcomment = ""
}
function end_header() {
    flush()
    if (nfn == 0) print "No functions of its own."
}
FNR == 1 {
    if (NR > 1) end_header()
    depth = 0; incom = 0; com = ""; com_end = -5; seen_first = 0; ppcont = 0; comcont = 0
    decl = ""; raw = ""; decl_start = 0; last_decl_end = -5; nfn = 0; ng = 0
    printf "\n## %s\n\n", FILENAME
}
# a multi-line comment goes on: its text joins com at depth 0
incom {
    t = $0; ends = sub(/\*\/.*$/, "", t)
    sub(/^[ \t]*\*?[ \t]?/, "", t)
    if (depth == 0) com = com " " t
    if (ends) {
        incom = 0
        if (depth == 0) {
            com_end = FNR
            if (!seen_first) { seen_first = 1; print first_sentence(trim(com)) "\n"; com = "" }
            else com = section(com)
        }
    }
    next
}
ppcont { ppcont = /\\[ \t]*$/; if (com_end == FNR - 1) com_end = FNR; next }
/^[ \t]*#/ {     # a comment above #defines still describes what follows them
    ppcont = /\\[ \t]*$/
    if (depth == 0 && decl == "" && com_end == FNR - 1) com_end = FNR
    next
}
/^[ \t]*\/\*/ && decl == "" {
    t = $0; sub(/^[ \t]*\/\*+[ \t]?/, "", t)
    closed = sub(/\*\/.*$/, "", t)
    if (depth == 0) {
        com = (FNR == com_end + 1 && comcont) ? com " " t : t
        comcont = 1
    }
    if (closed) {
        if (depth == 0) {
            com_end = FNR
            if (!seen_first) { seen_first = 1; print first_sentence(trim(com)) "\n"; com = "" }
            else com = section(com)
        }
    } else incom = 1
    next
}
/^[ \t]*$/ { if (depth == 0 && decl == "") comcont = 0; next }
# the extern "C" block of a C++ compiler (its braces are not a scope)
/^[ \t]*extern "C"[ \t]*\{[ \t]*$/ || (/^[ \t]*\}[ \t]*$/ && depth == 0 && decl == "") { next }
/^[ \t]*\/\// { next }
{
    code = uncomment($0)
    if (code ~ /\/\*/) { incom = 1; sub(/\/\*.*$/, "", code) }   # a comment opens here
    if (depth > 0) {
        depth += gsub(/\{/, "{", code) - gsub(/\}/, "}", code)
        if (depth == 0 && body_end) { body_end = 0; last_decl_end = FNR }
        if (depth == 0 && tcom_open) { tcom_open = 0; tcom_end = FNR }
        next
    }
    if (decl == "") { decl_start = FNR; raw = "" }
    decl = decl " " code
    raw = raw " " $0
    opens = gsub(/\{/, "{", code); closes = gsub(/\}/, "}", code)
    if (decl !~ /[;{]/) next                     # continues on the next line
    whole = decl; decl = ""
    is_fn = whole ~ /tdm_[a-zA-Z0-9_]+[ \t]*\(/ && whole !~ /^[ \t]*(typedef|struct|enum|union)[ \t{]/ \
            && whole !~ /^[ \t]*extern[ \t]/ && whole !~ /\(\*/
    if (opens > closes) { depth = opens - closes; body_end = is_fn }
    if (!is_fn) {
        # a type and the function right after it that fills it: the
        # comment above the type is the contract of the function too
        flush()
        if (depth == 0 && com_end == decl_start - 1 && com != "") { tcom = com; tcom_end = FNR }
        else if (depth > 0 && com_end == decl_start - 1 && com != "") { tcom = com; tcom_open = 1 }
        else tcom = ""
        com = ""
        next
    }
    nfn++
    # the comment right above it opens a group; a declaration right after
    # the previous one (no blank, no comment) joins its group
    if (com_end == decl_start - 1 && com != "") {
        flush(); gcomment = com; com = ""
    } else if (last_decl_end == decl_start - 1 && ng > 0) {
        # the same group
    } else if (tcom != "" && tcom_end == decl_start - 1) {
        flush(); gcomment = tcom
    } else {
        flush(); gcomment = ""
    }
    tcom = ""
    gtrail[ng + 1] = trailing(raw)
    group[++ng] = proto(raw)
    if (depth == 0) last_decl_end = FNR
}
END { if (NR > 0) end_header() }
' $headers); }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-api.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
gen > "$tmp/all"
# the names of the functions a bullet declares: in its prototypes, before
# its contract (": " after the last backtick of the prototypes)
names() {
  grep -E '^- `' | sed 's/`: .*$//' | grep -oE 'tdm_[A-Za-z0-9_]+\(' | tr -d '(' | sort -u
}

if [ $check = 1 ]; then
  names < "$tmp/all" > "$tmp/want"
  cat "$root/docs/API.md" "$root"/docs/api/*.md 2>/dev/null | names > "$tmp/have"
  missing=$(comm -23 "$tmp/want" "$tmp/have")
  stale=$(comm -13 "$tmp/want" "$tmp/have")
  [ -z "$missing" ] || { echo "api-doc: docs/api/*.md lack (run make api-doc):"; printf '  %s\n' $missing; }
  [ -z "$stale" ] || { echo "api-doc: docs/api/*.md name what no public header declares (run make api-doc):"; printf '  %s\n' $stale; }
  [ -z "$missing$stale" ] || exit 1
  echo "api-doc: docs/api/*.md name every public function ($(wc -l < "$tmp/want"))"
  exit 0
fi

# one page per floor, and the index
mkdir -p "$root/docs/api"
rm -f "$root"/docs/api/*.md
awk -v dir="$root/docs/api" '
/^## / { f = $2; sub(/\/.*/, "", f)
         if (f != cur) {
             if (out) close(out)
             cur = f; out = dir "/" f ".md"
             printf "# The C API: %s/\n\n[The floors](../API.md) | generated by tools/api-doc.sh from %s/*.h (`make api-doc`)\n\n", f, f > out
         } }
out { print > out }
' "$tmp/all"
{
  cat <<'HEAD'
# The C API, floor by floor

Every public function of tandem's library, generated from its public
headers by `tools/api-doc.sh` (`make api-doc`; tests/test_api_doc.c fails
when a public function is missing from these pages): one page per floor,
and on it, for each header, its opening sentence, then each function's
prototype and the comment above it in the header, which is its contract.
The floors are listed bottom up: a floor uses only those before it
(docs/ARCHITECTURE.md; `make check-layers` enforces it).

Conventions of every function: a `tdm_status` return (0 is
`TDM_STATUS_OK`; `tdm_error_message()` says what failed, with which value
and what to do), `_init` allocates what its caller then owns and
`_free(NULL)` is a no-op, "borrowed" pointers stay the caller's, counts
are elements and sizes bytes. Build against the installed headers and
library with `pkg-config --cflags --libs tandem` (README, "Using the
library"); C++ programs include the same headers (they have `extern "C"`
guards). Complete programs: examples/ddp_train.c (DDP) and
examples/fsdp_train.c (FSDP).

| floor | functions | headers |
|---|---:|---|
HEAD
  for f in $floors; do
    [ -e "$root/docs/api/$f.md" ] || continue
    n=$(names < "$root/docs/api/$f.md" | wc -l)
    hs=$(sed -n 's|^## [^/]*/\(.*\)$|\1|p' "$root/docs/api/$f.md" | tr '\n' ' ' | sed 's/ $//; s/ /, /g')
    printf '| [%s/](api/%s.md) | %s | %s |\n' "$f" "$f" "$n" "$hs"
  done
} > "$root/docs/API.md"
echo "api-doc: wrote docs/API.md and docs/api/*.md ($(names < "$tmp/all" | wc -l) functions)"
