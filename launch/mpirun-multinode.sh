#!/usr/bin/env bash
# fluxrt on several nodes with Open MPI (docs/multinode.md): HOSTS=node1,node2 GPUS=8 bash launch/mpirun-multinode.sh
# Every node needs the same Python environment and this checkout at the same path.
set -euo pipefail
hosts=${HOSTS:?comma-separated node names}
gpus=${GPUS:-8}
nodes=$(tr ',' '\n' <<<"$hosts" | wc -l)
export NVSHMEM_HCA_LIST=${NVSHMEM_HCA_LIST:-mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7}
export NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mpirun -np $((nodes * gpus)) --host "$(sed "s/\(,\|$\)/:$gpus\1/g" <<<"$hosts")" --map-by ppr:"$gpus":node \
  --bind-to none -x PATH -x PYTHONPATH -x LD_LIBRARY_PATH -x PYTHONUNBUFFERED -x NVSHMEM_DISABLE_NVLS \
  -x NVSHMEM_HCA_LIST -x NVSHMEM_SYMMETRIC_SIZE=4G ${NVSHMEM_IB_ENABLE_IBGDA:+-x NVSHMEM_IB_ENABLE_IBGDA} \
  python -m mpi4py -m pytest tests/gpu/test_multinode.py -q
