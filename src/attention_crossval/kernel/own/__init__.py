"""The project's own CuTe DSL kernels (SM90, SM100) and the code they share."""
