// python/kitsune/csrc/torch_headers.h — the torch headers every op file uses, in one
// place so that tools/build_bridge.sh can precompile them: parsing them costs a
// translation unit about 16 s of CPU, loading them precompiled about 4.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
