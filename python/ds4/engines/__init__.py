"""Engine implementations: the NumPy reference transformer and llama.cpp."""
