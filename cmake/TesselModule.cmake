# tessel_module(NAME DEPS ...): one static library per folder of src/tessel,
# built from every .cpp in that folder (recursively). Each module names the
# modules and packages it depends on, so a module builds and tests alone.
function(tessel_module name)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  if(NOT sources)  # a header-only module
    add_library(tessel_${name} INTERFACE)
    target_include_directories(tessel_${name} INTERFACE ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(tessel_${name} INTERFACE ${ARG_DEPS})
    return()
  endif()
  add_library(tessel_${name} STATIC ${sources})
  target_include_directories(tessel_${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(tessel_${name} PUBLIC ${ARG_DEPS} PRIVATE tessel_warnings)
endfunction()

# tessel_unit_tests(MODULE DEPS ...): tests/unit/<module>/*.cpp -> one gtest binary.
function(tessel_unit_tests module)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/unit/${module}/*.cpp)
  if(NOT sources)
    return()
  endif()
  add_executable(unit_${module} ${sources})
  target_link_libraries(unit_${module} PRIVATE ${ARG_DEPS} GTest::gtest_main tessel_warnings)
  target_include_directories(unit_${module} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  add_test(NAME unit_${module} COMMAND unit_${module})
  # ctest -j2 runs two binaries at once on 2 cores: idle OpenMP threads must sleep, not
  # spin, or an oversubscribed test runs 100x slower (seen under load).
  set_tests_properties(unit_${module} PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2;OMP_WAIT_POLICY=passive"
                       LABELS unit)
endfunction()

# The modules whose MPI tests run whole with 3 ranks too: an odd world, where pairings and even
# splits break (a few seconds each).
set(TESSEL_MPI_ODD_WORLD_MODULES comm parallel)

# tessel_mpi_tests(MODULE DEPS ... [ALSO_NP n ... ALSO_FILTER pattern]): tests/mpi/<module>/*.cpp
# -> one gtest binary with an MPI main, registered under mpirun with 2 and with 4 ranks (and 3
# for TESSEL_MPI_ODD_WORLD_MODULES); and with each ALSO_NP rank count for the tests ALSO_FILTER
# selects (mpi_<module>_<np>_only).
function(tessel_mpi_tests module)
  cmake_parse_arguments(ARG "" "ALSO_FILTER" "DEPS;ALSO_NP" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/mpi/${module}/*.cpp)
  if(NOT sources)
    return()
  endif()
  add_executable(mpi_${module} ${sources} ${CMAKE_CURRENT_SOURCE_DIR}/mpi/mpi_test_main.cpp)
  target_link_libraries(mpi_${module} PRIVATE ${ARG_DEPS} tessel_comm GTest::gtest tessel_warnings)
  target_include_directories(mpi_${module} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  # OpenMPI's dlopen'ed components keep allocations that LeakSanitizer cannot attribute
  # to a library (so no suppression matches): MPI tests run the sanitizers without leak
  # detection; the single-process tests keep it.
  set(sanitizer_env "")
  if(TESSEL_SANITIZE)
    set(sanitizer_env ";ASAN_OPTIONS=detect_leaks=0")
  endif()
  set(whole 2 4)
  if(module IN_LIST TESSEL_MPI_ODD_WORLD_MODULES)
    list(APPEND whole 3)
  endif()
  foreach(np ${whole} ${ARG_ALSO_NP})
    set(name mpi_${module}_np${np})
    set(filter "")
    if(NOT np IN_LIST whole)
      set(name mpi_${module}_np${np}_only)
      set(filter --gtest_filter=${ARG_ALSO_FILTER})
    endif()
    add_test(NAME ${name}
             COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none -np ${np}
                     -x OMP_NUM_THREADS=1
                     $<TARGET_FILE:mpi_${module}> ${filter})
    set_tests_properties(${name} PROPERTIES
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1${sanitizer_env}"
      LABELS mpi PROCESSORS ${np})
  endforeach()
endfunction()
