"""Hardware profiles (a GPU's datasheet figures and the GEMM curve fitted to its operator
timings, profiles/*.json; a calibrated CPU step-time profile, profiles/cpu/) and the
roofline step-time model made from them. Torch-free and a leaf: the simulator, the
planner and a fleet gateway (which splits a replica's cost by it) all read it."""
