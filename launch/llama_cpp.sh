#!/usr/bin/env bash
# llama.cpp, CPU only, built from the source that the PyPI sdist of llama-cpp-python
# vendors (vendor/llama.cpp): the reference decoder that launch/real_model.sh measures
# specjax against. Never a dependency of specjax: a cached build for benchmarks.
#
#   launch/llama_cpp.sh            # builds once, prints the folder holding the binaries
#   LLAMA_CPP_PYTHON=0.3.36 SDIST=path/to/llama_cpp_python-0.3.36.tar.gz launch/llama_cpp.sh
#
# Binaries: llama-bench, llama-lookup, llama-quantize, llama-simple, llama-completion,
# in $SPECJAX_CACHE/llama.cpp/<version>/bin (default ~/.cache/specjax). Build: cmake,
# Release, -march=native (GGML_NATIVE; AMX off where the CPU has it, see below), static,
# no curl/openssl, no tests or server; about 10 minutes on 2 cores. JOBS sets the parallel
# compile jobs (default: nproc).
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
ROOT=${SPECJAX_CACHE:-$HOME/.cache/specjax}/llama.cpp/$VERSION
TARGETS=(llama-bench llama-lookup llama-quantize llama-simple llama-completion)
PYTHON=${PYTHON:-python3}

have_all() {
  for t in "${TARGETS[@]}"; do [[ -x $ROOT/bin/$t ]] || return 1; done
}

if have_all; then
  echo "$ROOT/bin"
  exit 0
fi
for tool in cmake "${CXX:-c++}"; do
  command -v "$tool" >/dev/null || { echo "llama_cpp.sh: '$tool' not found (cmake and a C++ compiler are needed)" >&2; exit 2; }
done

mkdir -p "$ROOT/src"
sdist=${SDIST:-$ROOT/src/llama_cpp_python-$VERSION.tar.gz}
if [[ ! -f $sdist ]]; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/src" >&2
fi
[[ -f $sdist ]] || { echo "llama_cpp.sh: no sdist at $sdist" >&2; exit 2; }
tar xzf "$sdist" -C "$ROOT/src" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src=$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp

# Where the CPU has AMX, llama.cpp's AMX kernels die with "Illegal instruction" on any prompt
# pass (seen on Sapphire Rapids class Xeons under KVM), and GGML_NATIVE (-march=native) turns
# them on whatever GGML_AMX_TILE/INT8/BF16 say; explicit -mno-amx-* compiler flags keep them
# off (GCC and Clang let an explicit -mno-X win over -march=native). The AVX-512/VNNI kernels that remain are the ones llama.cpp uses on such hosts.
flags=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  flags=(-DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx")
fi
cmake -S "$src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF "${flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON >&2
cmake --build "$ROOT/build" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}" >&2
mkdir -p "$ROOT/bin"
for t in "${TARGETS[@]}"; do cp "$ROOT/build/bin/$t" "$ROOT/bin/"; done
rm -rf "$ROOT/src/llama_cpp_python-$VERSION"
echo "$ROOT/bin"
