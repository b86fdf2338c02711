"""The decoding loops: warping and sampling, ArS (Algorithm 1), SpS (Algorithm 2), the one
generation path (`program`) and the public API (`api`)."""
