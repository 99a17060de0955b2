// tests/gpu/oob_write.cu — an out-of-bounds write planted inside a Kitsune pool.
//
// A 1000-byte block is taken from a pool on the CUDA backend; a kernel writes its
// last byte (fine) and then one 1 KiB past it: still inside the pool's segment (so
// cudaMalloc-level checking sees nothing wrong), but outside every block. Kitsune
// registers segments as NVTX sub-allocator heaps and blocks as regions, so
//   compute-sanitizer --tool memcheck --nvtx yes build/tests/oob_write
// reports the second write. `oob_write --in-bounds` writes only inside the block
// (the control: no error). Exit code 0 unless a CUDA or pool call fails.
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

#include "kitsune/alloc.h"

__global__ void poke(unsigned char* p, size_t offset) { p[offset] = 42; }

int main(int argc, char** argv) {
  bool in_bounds = argc > 1 && !strcmp(argv[1], "--in-bounds");
  kt_pool_options o;
  kt_pool_options_default(&o);
  kt_pool_t* pool = nullptr;
  if (kt_pool_create(&o, kt_cuda_backend(), &pool) != KT_OK) { fprintf(stderr, "pool create failed\n"); return 1; }
  void* before = nullptr;
  void* block = nullptr;
  kt_alloc(pool, 1000, nullptr, &before);    // a neighbour, so the slab around the block is live
  if (kt_alloc(pool, 1000, nullptr, &block) != KT_OK) { fprintf(stderr, "alloc failed\n"); return 1; }
  poke<<<1, 1>>>(static_cast<unsigned char*>(block), 999);                       // the block's last byte
  if (!in_bounds) poke<<<1, 1>>>(static_cast<unsigned char*>(block), 1000 + 1024);  // planted: past the block
  cudaError_t e = cudaDeviceSynchronize();
  printf("oob_write: block %p (1000 bytes), %s write done, cuda: %s\n", block,
         in_bounds ? "in-bounds" : "out-of-bounds", cudaGetErrorString(e));
  kt_free(pool, block, 1000, nullptr);
  kt_free(pool, before, 1000, nullptr);
  kt_pool_destroy(pool);
  return 0;
}
