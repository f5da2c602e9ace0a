// torchdist_ext._C: loading it registers every tdx op (csrc/torch_bindings.cpp
// and the families' host code). Its Python members are the process-wide
// switches of the native code, wrapped by torchdist_ext/cpu_isa.py and
// torchdist_ext/_index_checks.py:
//   cpu_isas() / supported_cpu_isas() / active_cpu_isa() / set_cpu_isa(name) -> previous
//   index_checks() / set_index_checks(enabled) -> previous
//   agreement_checks() / set_agreement_checks(mode) -> previous /
//   check_agreement(group_name, device, op, fields, error_kind, error)   (comm/agreement_mode.h)
//   track_cpu_memory() / tracking_cpu_memory() / cpu_memory_stats() -> (allocated, peak) /
//   reset_cpu_peak_memory()   (cpu_memory.h)
// and the communication ledger's functions (comm/ledger_backend.h), wrapped by
// torchdist_ext/ledger.py.

#include <Python.h>

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

#include "comm/agreement_mode.h"
#include "comm/ledger_backend.h"
#include "cpu_memory.h"
#include "kernels/cpu/isa.h"
#include "ops/index_checks.h"

namespace {

using tdx::kernels::CpuIsa;

PyObject* isa_names(bool supported_only) {
  PyObject* names = PyList_New(0);
  for (const CpuIsa isa : tdx::kernels::kCpuIsas) {
    if (supported_only && !tdx::kernels::cpu_supports(isa)) continue;
    PyObject* name = PyUnicode_FromString(tdx::kernels::cpu_isa_name(isa));
    PyList_Append(names, name);
    Py_DECREF(name);
  }
  PyObject* result = PyList_AsTuple(names);
  Py_DECREF(names);
  return result;
}

PyObject* cpu_isas(PyObject*, PyObject*) { return isa_names(false); }

PyObject* supported_cpu_isas(PyObject*, PyObject*) { return isa_names(true); }

PyObject* active_cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(tdx::kernels::cpu_isa_name(tdx::kernels::active_cpu_isa()));
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyObject* set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  CpuIsa isa;
  if (!tdx::kernels::parse_cpu_isa(name, &isa)) {
    PyObject* all = isa_names(false);
    PyErr_Format(PyExc_ValueError, "isa=%R names no CPU kernel ISA; use one of %S", arg, all);
    Py_DECREF(all);
    return nullptr;
  }
  try {
    const CpuIsa previous = tdx::kernels::active_cpu_isa();
    tdx::kernels::set_active_cpu_isa(isa);
    return PyUnicode_FromString(tdx::kernels::cpu_isa_name(previous));
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyObject* index_checks(PyObject*, PyObject*) { return PyBool_FromLong(tdx::ops::index_checks_enabled()); }

PyObject* set_index_checks(PyObject*, PyObject* arg) {
  const int enabled = PyObject_IsTrue(arg);
  if (enabled < 0) return nullptr;
  const bool previous = tdx::ops::index_checks_enabled();
  tdx::ops::set_index_checks(enabled != 0);
  return PyBool_FromLong(previous);
}

PyObject* track_cpu_memory(PyObject*, PyObject*) {
  try {
    tdx::track_cpu_memory();
  } catch (const std::runtime_error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* tracking_cpu_memory(PyObject*, PyObject*) { return PyBool_FromLong(tdx::tracking_cpu_memory()); }

PyObject* cpu_memory_stats(PyObject*, PyObject*) {
  if (!tdx::tracking_cpu_memory()) {
    PyErr_SetString(PyExc_RuntimeError, "CPU memory is not counted: call torchdist_ext.cpu_memory.track() first");
    return nullptr;
  }
  const tdx::CpuMemoryStats stats = tdx::cpu_memory_stats();
  return Py_BuildValue("(LL)", static_cast<long long>(stats.allocated), static_cast<long long>(stats.peak));
}

PyObject* reset_cpu_peak_memory(PyObject*, PyObject*) {
  tdx::reset_cpu_peak_memory();
  Py_RETURN_NONE;
}

PyObject* agreement_checks(PyObject*, PyObject*) { return PyUnicode_FromString(tdx::comm::agreement_checks().c_str()); }

PyObject* set_agreement_checks(PyObject*, PyObject* arg) {
  const char* mode = PyUnicode_AsUTF8(arg);
  if (mode == nullptr) return nullptr;
  try {
    return PyUnicode_FromString(tdx::comm::set_agreement_checks(mode).c_str());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyObject* check_agreement(PyObject*, PyObject* args) {
  const char *group_name, *device, *op, *fields, *error;
  int error_kind;
  if (!PyArg_ParseTuple(args, "ssssis", &group_name, &device, &op, &fields, &error_kind, &error)) return nullptr;
  PyObject* raised = nullptr;  // the Python exception type, with `message`
  std::string message;
  Py_BEGIN_ALLOW_THREADS  // the check waits on the group's collectives
  try {
    tdx::comm::check_agreement_of_group(group_name, device, op, fields, error_kind, error);
  } catch (const c10::ValueError& e) {
    raised = PyExc_ValueError, message = e.what_without_backtrace();
  } catch (const c10::TypeError& e) {
    raised = PyExc_TypeError, message = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    raised = PyExc_RuntimeError, message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    raised = PyExc_RuntimeError, message = e.what();
  } catch (...) {  // never unwind past Py_END_ALLOW_THREADS
    raised = PyExc_RuntimeError, message = "check_agreement: an unknown C++ exception";
  }
  Py_END_ALLOW_THREADS
  if (raised == nullptr) Py_RETURN_NONE;
  PyErr_SetString(raised, message.c_str());
  return nullptr;
}

PyMethodDef methods[] = {
    {"cpu_isas", cpu_isas, METH_NOARGS, "Every CPU kernel ISA, narrowest first."},
    {"supported_cpu_isas", supported_cpu_isas, METH_NOARGS, "The CPU kernel ISAs this CPU runs."},
    {"active_cpu_isa", active_cpu_isa, METH_NOARGS, "The ISA whose CPU kernels run."},
    {"set_cpu_isa", set_cpu_isa, METH_O, "Makes an ISA the active one; returns the previous one."},
    {"index_checks", index_checks, METH_NOARGS, "Whether ops check index values."},
    {"set_index_checks", set_index_checks, METH_O, "Switches index checks; returns the previous setting."},
    {"agreement_checks", agreement_checks, METH_NOARGS, "Which calls the rank-agreement check covers."},
    {"set_agreement_checks", set_agreement_checks, METH_O, "Sets the agreement checks; returns the previous mode."},
    {"check_agreement", check_agreement, METH_VARARGS, "The rank-agreement check of a Python layer's call."},
    {"track_cpu_memory", track_cpu_memory, METH_NOARGS, "Counts CPU tensor memory from now on (cpu_memory.h)."},
    {"tracking_cpu_memory", tracking_cpu_memory, METH_NOARGS, "Whether CPU tensor memory is counted."},
    {"cpu_memory_stats", cpu_memory_stats, METH_NOARGS, "(allocated, peak) bytes of counted CPU storages."},
    {"reset_cpu_peak_memory", reset_cpu_peak_memory, METH_NOARGS, "Sets the peak to the bytes allocated now."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  // A bad TDX_CPU_ISA fails the import, naming the variable, instead of the first op call.
  try {
    tdx::kernels::active_cpu_isa();
    tdx::comm::agreement_checks();  // likewise a bad TDX_AGREEMENT_CHECKS
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  PyObject* created = PyModule_Create(&module);
  if (created != nullptr && tdx::comm::add_ledger_functions(created) != 0) {
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
