#!/usr/bin/env bash
# The internode network leg through NVSHMEM's host proxy on one machine: peer-to-peer off
# between the PEs, a remote transport over loopback.
#   bash dev/gpu/proxy.sh WHEELS_DIR     # WHEELS_DIR holds the libucx-cu13 wheel
#   DRY_RUN=1 bash dev/gpu/proxy.sh WHEELS_DIR
# The nvidia-nvshmem-cu13 wheel ships nvshmem_transport_ucx.so.3 (and _libfabric), which link
# UCX's libucp/libucs; the image has no UCX, so the libucx-cu13 wheel's libucx/lib goes on
# LD_LIBRARY_PATH. Every run sets NVSHMEM_DISABLE_P2P=1 (no load/store or P2P puts between
# PEs, so nvshmem_ptr is null for another virtual node and our kernels put through NVSHMEM),
# NVSHMEM_REMOTE_TRANSPORT=ucx (TRANSPORT), UCX_TLS=tcp,cuda_copy,self (staged through host
# memory over loopback TCP), UCX_NET_DEVICES=lo, NVSHMEM_IB_ENABLE_IBGDA=0, NVSHMEM_DEBUG=INFO
# with NVSHMEM_DEBUG_SUBSYS (default INIT,BOOTSTRAP,TRANSPORT,PROXY: where set-up stops)
# (which transport each PE pair got, into the log).
# Pieces (PIECES, default "plugins tier sweep"), each under its limit, never past BUDGET:
#   plugins  the wheel's transport plugins and what each fails to resolve (ldd), before and
#            after the UCX wheel's folder is on the path; libfabric: no wheel ships
#            libfabric.so.1, so that plugin is only listed
#   tier     the internode tier's matrix on virtual nodes PROXY_SHAPES (default "2x1 2x2";
#            MDEEP_TEST_CALLS, default 20) (TIER_TIMEOUT, 200 each)
#   sweep    megatron_deepep.tools.multinode_check's sweep at 2x1 and 2x2, 4096 tokens, hidden
#            7168, top-8: µs and GB/s of the network leg on the proxy path; its JSON
#            (network_gbps per phase) is the internode model's input,
#            .bench_out/evidence/proxy_model.json (SWEEP_TIMEOUT, 150 each)
# WITH_MPS=1 runs them under CUDA MPS (dev/gpu/mps.sh's daemon, 100/R % each: NVSHMEM's full
# several-PEs-per-GPU mode instead of the limited one). When a run fails, the record keeps
# NVSHMEM's first error lines: the exact blocker. The record quotes NVSHMEM's own messages of
# each run (dev/gpu/nvshmem_diag.py: its transports, its first warnings and errors, its last
# lines: where it stopped, or that it finished) beside pytest's verdict.
# Writes benchmarks/<card>_<date>_proxy.md and .log.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/evidence_lib.sh"
ev_init proxy
if [ $# -ne 1 ]; then
  echo "usage: bash dev/gpu/proxy.sh WHEELS_DIR (holding the libucx-cu13 wheel)"
  exit 2
fi
ev_need_dir proxy WHEELS_DIR "$1"
WHEELS=$(cd "$1" && pwd)
PIECES=${PIECES:-plugins tier sweep}
for piece in $PIECES; do
  case $piece in plugins|tier|sweep) ;; *)
    echo "proxy: unknown piece '$piece' in PIECES (plugins, tier, sweep)"; exit 2 ;;
  esac
done
TRANSPORT=${TRANSPORT:-ucx}
CALLS=${MDEEP_TEST_CALLS:-20}
if ! ls "$WHEELS"/libucx*.whl >/dev/null 2>&1; then
  echo "proxy: no libucx*.whl in $WHEELS (pip download libucx-cu13 for Python 3.12 there)"
  exit 2
fi
WITH_MPS=${WITH_MPS:-0}
ev_say "pieces: $PIECES; remote transport $TRANSPORT over loopback; wheels $WHEELS;" \
  "MPS: $WITH_MPS"
ev_versions
TABLE=$EV_LOGS/table.md
: > "$TABLE"
UCX_SITE=""
if ev_is_dry; then
  echo "dry run: pip install $WHEELS/libucx*.whl into a fresh folder; its libucx/lib on" \
    "LD_LIBRARY_PATH"
else
  UCX_SITE=$(mktemp -d "${TMPDIR:-/tmp}/proxy_ucx.XXXXXX")
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$UCX_SITE" \
    "$WHEELS"/libucx*.whl || { echo "proxy: pip could not install the UCX wheel"; exit 2; }
fi
if [ "$WITH_MPS" = 1 ]; then  # NVSHMEM's full several-PEs-per-GPU mode (shares <= 100%)
  if ev_is_dry; then echo "dry run: MPS daemon (dev/gpu/evidence_lib.sh ev_start_mps)"
  else ev_start_mps || exit 3; fi
fi
# mps_share RANKS: the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under WITH_MPS=1.
mps_share() { [ "$WITH_MPS" = 1 ] && echo "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / $1))"; }
NVSHMEM_LIB=$(python3 -c "import nvidia.nvshmem as m, os; \
print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
PROXY_ENV=(NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT="$TRANSPORT" NVSHMEM_IB_ENABLE_IBGDA=0
           UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo NVSHMEM_DEBUG=INFO
           NVSHMEM_DEBUG_SUBSYS="${NVSHMEM_DEBUG_SUBSYS:-INIT,BOOTSTRAP,TRANSPORT,PROXY}"
           LD_LIBRARY_PATH="$UCX_SITE/libucx/lib:$UCX_SITE/libucx/lib/ucx:${LD_LIBRARY_PATH:-}")

# blocker LOG: NVSHMEM's and the test's first error lines (what stopped the run).
blocker() {
  grep -m 6 -E "WARN|ERROR|error|Error|nvshmem.*fail|transport.*(not|fail)" "$1" \
    | grep -v "^WARNING: " | cut -c1-220
}

case " $PIECES " in *" tier "*|*" sweep "*) ev_precompile_tier ;; esac
for piece in $PIECES; do
  case $piece in
    plugins)
      if ev_is_dry; then echo "dry run: ldd of $NVSHMEM_LIB/nvshmem_transport_*.so*"; continue; fi
      {
        echo "- NVSHMEM wheel's transport plugins ($NVSHMEM_LIB), unresolved libraries without"
        echo "  and with the UCX wheel's folder on LD_LIBRARY_PATH:"
        for plugin in "$NVSHMEM_LIB"/nvshmem_transport_*.so*; do
          [ -e "$plugin" ] || { echo "  none found"; break; }
          before=$(ldd "$plugin" 2>&1 | grep "not found" | awk '{print $1}' | tr '\n' ' ')
          after=$(env LD_LIBRARY_PATH="$UCX_SITE/libucx/lib" ldd "$plugin" 2>&1 \
            | grep "not found" | awk '{print $1}' | tr '\n' ' ')
          echo "  - $(basename "$plugin"): missing ${before:-nothing}; with UCX:" \
            "${after:-nothing}"
        done
      } | tee -a "$TABLE"
      ev_row "transport plugins" 0 0 "see the record"
      ;;
    tier)
      for shape in ${PROXY_SHAPES:-2x1 2x2}; do
        log=$EV_LOGS/tier_$shape.log
        ranks=$(( ${shape%x*} * ${shape#*x} ))
        # shellcheck disable=SC2046
        ev_piece "internode tier $shape via $TRANSPORT" "${TIER_TIMEOUT:-200}" "$log" env \
          "${PROXY_ENV[@]}" $(mps_share "$ranks") MDEEP_TEST_NODES=$shape \
          MDEEP_TEST_CALLS="$CALLS" python3 -m pytest -m gpu -q -rA -p no:cacheprovider -x \
          tests/gpu/test_internode_gpu.py -k "test_internode_matches_reference and $shape"
        result=$(ev_is_dry && echo "dry run" || tail -n 1 "$log")
        ev_row "internode tier $shape, P2P off, $TRANSPORT" "$PIECE_RC" "$PIECE_S" "$result"
        if ! ev_is_dry; then
          {
            echo "- internode tier matrix on $shape virtual nodes, NVSHMEM_DISABLE_P2P=1,"
            echo "  NVSHMEM_REMOTE_TRANSPORT=$TRANSPORT, $CALLS calls: rc $PIECE_RC in $PIECE_S s:"
            echo "  $result"
            [ "$PIECE_RC" != 0 ] && blocker "$log" | sed 's/^/    blocker: /'
            echo
            python3 dev/gpu/nvshmem_diag.py "$log"
          } >> "$TABLE"
        fi
      done
      ;;
    sweep)
      for shape in 2x1 2x2; do
        per_node=${shape#*x}
        ranks=$(( ${shape%x*} * per_node ))
        log=$EV_LOGS/sweep_$shape.log
        json=$EV_LOGS/sweep_$shape.json
        # shellcheck disable=SC2046
        ev_piece "sweep $shape via $TRANSPORT" "${SWEEP_TIMEOUT:-150}" "$log" env \
          "${PROXY_ENV[@]}" $(mps_share "$ranks") python3 -m megatron_deepep.tools.multinode_check \
          --spawn "$ranks" --num-ranks-per-node "$per_node" --skip-check --sweep-tokens 4096 \
          --sweep-hidden 7168 --json "$json"
        ev_row "sweep $shape, P2P off, $TRANSPORT" "$PIECE_RC" "$PIECE_S" \
          "$(ev_is_dry && echo "dry run" || (grep -E "^ +4096 +7168" "$log" | \
            awk '{print $3": "$8" GB/s/rank"}' | tr '\n' ' '))"
        if ! ev_is_dry; then
          { echo; echo "multinode_check sweep on $shape virtual nodes through NVSHMEM's proxy" \
              "($TRANSPORT over loopback):"
            grep -E "tokens|^ +[0-9]+ +[0-9]+ +(dispatch|combine)" "$log" | head -8
            [ "$PIECE_RC" != 0 ] && blocker "$log" | sed 's/^/    blocker: /'
          } >> "$TABLE"
          # The model's input: the 2x2 sweep (two ranks share each "node"), labelled.
          if [ -s "$json" ]; then
            python3 - "$json" "$EV_OUT/proxy_model.json" "$TRANSPORT" "$shape" <<'PY'
import json
import sys

src, dst, transport, shape = sys.argv[1:]
with open(src) as f:
    doc = json.load(f)
out = {k: v for k, v in doc.items() if k in ("dispatch", "combine")}
out["source"] = (f"NVSHMEM host proxy, NVSHMEM_REMOTE_TRANSPORT={transport} over loopback "
                 f"TCP, P2P off, {shape} virtual nodes on one GPU ({doc.get('source', '')})")
with open(dst, "w") as f:
    json.dump(out, f, indent=1)
PY
          fi
        fi
      done
      ;;
  esac
done
ev_is_dry || cat "$EV_LOGS"/*.log > "$EV_LOGS/all.txt" 2>/dev/null
ev_record proxy "The network leg through NVSHMEM's proxy ($TRANSPORT over loopback), one GPU" \
  "PIECES='$PIECES' TRANSPORT=$TRANSPORT bash dev/gpu/proxy.sh WHEELS_DIR" "$EV_LOGS/all.txt" \
  "$TABLE"
ev_finish
