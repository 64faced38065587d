"""One model runner per rank (sampling on rank 0), step-input packing, decode CUDA graphs, tensor-parallel ranks."""
