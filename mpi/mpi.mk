# mpi/mpi.mk: the MPI communicator's part of the build, included by
# GNUmakefile when MPI's development files were found (MPI_CPPFLAGS set).
# Defines MPI_OBJ (linked into the CLI and every test binary directly,
# not through libtandem.a, so that tools/ and tests/ can reach it through
# weak symbols, as they reach cuda/) and MPI_LDLIBS.
#
#   MPICC        the MPI compiler wrapper asked for the flags (default:
#                mpicc in PATH; Open MPI's --showme:compile/--showme:link)
#   MPI=0        leave mpi/ out even when MPI is installed

MPI_C_SRC := $(wildcard mpi/*.c)
MPI_OBJ   := $(MPI_C_SRC:%.c=$(BUILD)/%.o)

# mpi/*.c use GNUmakefile's generic C rule; only they see mpi.h.
# override: `make tsan` sets CPPFLAGS on its command line, which would
# otherwise drop MPI's include path (mpi.h not found)
$(MPI_OBJ): override CPPFLAGS += $(MPI_CPPFLAGS)

-include $(MPI_OBJ:.o=.d)
