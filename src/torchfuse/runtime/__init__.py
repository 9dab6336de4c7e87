"""Runtime support: building and loading generated kernels (see `cpp_build`)."""
