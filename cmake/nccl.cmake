# SPDX-License-Identifier: MIT
# NCCL's library as the imported target moelab::nccl, when found: the CUDA toolkit's copy (its
# lib64 or lib), NCCL_HOME, or the system paths.  CUDAToolkit must be found first.  The build
# includes this file, and so does the installed package (moelabConfig.cmake), so that a program
# linking the static library looks for NCCL where the build did.
find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT} ENV NCCL_HOME
             PATH_SUFFIXES lib64 lib)
if(NCCL_LIBRARY AND NOT TARGET moelab::nccl)
  add_library(moelab::nccl UNKNOWN IMPORTED)
  set_target_properties(moelab::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}")
endif()
