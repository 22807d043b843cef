# SPDX-License-Identifier: MIT
# The installed package: the shared and static libraries, moelab.h, the CMake package
# (find_package(moelab): moelab::moelab and moelab::moelab_static) and moelab.pc for pkg-config.
# Both descriptions carry what a static link needs (MOE_LINK_DEPS), and both are relocatable:
# `cmake --install build --prefix DIR` gives files that work from DIR.
include(CMakePackageConfigHelpers)

set(MOE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/moelab)
install(TARGETS moelab moelab_static EXPORT moelabTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES lib/moelab.h lib/moelab_dlpack.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT moelabTargets NAMESPACE moelab:: DESTINATION ${MOE_CMAKE_DIR})
configure_package_config_file(cmake/moelabConfig.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/moelabConfig.cmake
                              INSTALL_DESTINATION ${MOE_CMAKE_DIR})
# One soname, libmoelab.so.<major>, for a whole major version (docs/abi.md).
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/moelabConfigVersion.cmake
                                 COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/moelabConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/moelabConfigVersion.cmake
              cmake/nccl.cmake DESTINATION ${MOE_CMAKE_DIR})

# Appends to the list `out` the linker arguments of the dependency `dep`: an imported target's
# file and, recursively, its own link interface; a path or a flag as it is; a name as -l<name>.
function(moe_pc_link_args dep out)
  set(args ${${out}})
  if(TARGET ${dep})
    get_target_property(file ${dep} IMPORTED_LOCATION)
    if(file)
      list(APPEND args ${file})
    endif()
    get_target_property(deps ${dep} INTERFACE_LINK_LIBRARIES)
    foreach(d ${deps})
      if(d AND NOT d MATCHES "^\\$<")
        moe_pc_link_args(${d} args)
      endif()
    endforeach()
  elseif(IS_ABSOLUTE "${dep}" OR dep MATCHES "^-")
    list(APPEND args ${dep})
  else()
    list(APPEND args -l${dep})
  endif()
  set(${out} ${args} PARENT_SCOPE)
endfunction()

set(MOE_PC_LIBS_PRIVATE)
foreach(dep ${MOE_LINK_DEPS} ${MOE_CXX_RUNTIME})
  moe_pc_link_args(${dep} MOE_PC_LIBS_PRIVATE)
endforeach()
if(MOE_SANITIZE)
  list(APPEND MOE_PC_LIBS_PRIVATE -fsanitize=address,undefined)
endif()
list(REMOVE_DUPLICATES MOE_PC_LIBS_PRIVATE)
list(JOIN MOE_PC_LIBS_PRIVATE " " MOE_PC_LIBS_PRIVATE)

# The prefix as a path from the .pc file's own folder, so that the file stays true wherever the
# tree is installed; absolute install folders are written as they are.
file(RELATIVE_PATH MOE_PC_UP /${CMAKE_INSTALL_LIBDIR}/pkgconfig /)
string(REGEX REPLACE "/$" "" MOE_PC_UP "${MOE_PC_UP}")
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(MOE_PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(MOE_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
configure_file(cmake/moelab.pc.in ${CMAKE_CURRENT_BINARY_DIR}/moelab.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/moelab.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
