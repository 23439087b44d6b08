"""CPU tuning: the core plan and raygen's own C++ kernels (csrc/), built on the machine
that runs them."""
