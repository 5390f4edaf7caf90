#!/bin/bash
# A/B of compile-time knobs on the EP = 1 dispatch (one device call): each variant is a full
# bench run with its defines; logs under $OUT (or /tmp). Usage: scripts/ab_knobs.sh "NAME=DEFS" ...
# where DEFS is a MEGATRON_DEEPEP_JIT_DEFINES list ("" for the defaults); a NAME ending in
# "-nopdl" also sets MEGATRON_DEEPEP_PDL=0 and prints the kernel profile.
set -u
out=${OUT:-/tmp}
shapes=${AB_SHAPES:-"4096,7168,256,8;8192,4096,64,6"}
for variant in "$@"; do
    name=${variant%%=*}
    defs=${variant#*=}
    extra=()
    pdl=1
    if [[ $name == *-nopdl ]]; then pdl=0; extra=(--profile); fi
    MEGATRON_DEEPEP_PDL=$pdl MEGATRON_DEEPEP_JIT_DEFINES=$defs python3 -m megatron_deepep.bench \
        --no-megatron --fp8 '' --num-sms 132 --shapes "$shapes" "${extra[@]}" \
        > "$out/ab_$name.log" 2>&1
    echo "== $name ($defs) rc=$?"
    grep -E '^\| *[0-9]|dispatch|combine|layout|expand' "$out/ab_$name.log" | head -30
done
