"""The Hopper backend's kernels (compute capability 9.x): a Gluon forward and warp-specialised backward kernels."""
