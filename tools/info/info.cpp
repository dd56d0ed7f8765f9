// SPDX-License-Identifier: Apache-2.0
// vmm-info: what this machine offers vmmalloc. Per CUDA device: name, memory, VMM-related
// attributes, allocation granularities for the property sets vmmalloc uses, and peer access.
// Without a usable driver/device it says why and describes the host backend instead.
// `vmm-info --json` prints the same facts as one JSON object. Exits 0 (2 for an unknown option).
//
// Read-only: it queries attributes and granularities, never allocates (no cuMemCreate, and
// never cuMulticastCreate: multicast support is reported from the attribute alone).
#include <vmmalloc/cuda_backend.hpp>
#include <vmmalloc/host_backend.hpp>

#include <cuda.h>  // CU_DEVICE_ATTRIBUTE_* numbers only; the driver is reached through cuda_backend

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tool_cli.hpp"

namespace {

using namespace vmm;

struct gran_row {
  const char* label;  // text label
  const char* key;    // JSON key
  chunk_props props;
  result<granularity_info> g;
};

struct device_report {
  int index = 0;
  std::string name;
  bool usable = false;     // cuda_backend(index).available()
  std::string message;     // its load_message() when not usable
  result<memory_info> mem;
  // Attributes: 1 yes, 0 no, -1 unknown (query failed).
  int vmm = -1, posix_fd = -1, fabric = -1, compression = -1, rdma_vmm = -1, multicast = -1;
  std::vector<gran_row> gran;
  std::vector<int> peer;   // peer[j]: 1 can access device j, 0 cannot, -1 unknown
};

struct report {
  bool available = false;  // cuda_backend(0) usable
  std::string message;     // cuda_backend(0).load_message()
  int driver_version = 0;
  std::vector<device_report> devices;
  // host backend (default options)
  host_backend_options host_opts;
  result<granularity_info> host_gran;
  result<memory_info> host_mem;
  unsigned host_caps = 0;
};

int flag(int attr) { return attr < 0 ? -1 : (attr != 0 ? 1 : 0); }

report collect() {
  report r;
  cuda_backend first(0);
  r.available = first.available();
  r.message = first.load_message();
  r.driver_version = first.driver_version();
  const int n = first.device_count();  // 0 when the driver is missing or cuInit failed
  std::vector<cuda_backend> backends;
  backends.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) backends.emplace_back(i);
  for (int i = 0; i < n; ++i) {
    cuda_backend& b = backends[static_cast<std::size_t>(i)];
    device_report d;
    d.index = i;
    d.name = first.device_name(i);
    d.usable = b.available();
    if (!d.usable) d.message = b.load_message();
    d.mem = b.mem_info();
    d.vmm = flag(first.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, i));
    d.posix_fd = flag(first.attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, i));
    d.fabric = flag(first.attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, i));
    d.compression = flag(first.attribute(CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED, i));
    d.rdma_vmm = flag(first.attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, i));
    d.multicast = flag(first.attribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, i));
    d.gran = {
        {"device", "device", {location_kind::device, i, false, ipc_kind::none}, {}},
        {"exportable (posix fd)", "exportable_posix_fd", {location_kind::device, i, false, ipc_kind::posix_fd}, {}},
        {"compressible", "compressible", {location_kind::device, i, true, ipc_kind::none}, {}},
        {"host_numa 0", "host_numa_0", {location_kind::host_numa, 0, false, ipc_kind::none}, {}},
    };
    for (gran_row& g : d.gran) g.g = b.granularity(g.props);
    for (int j = 0; j < n; ++j) d.peer.push_back(d.usable ? (b.can_access_peer(i, j) ? 1 : 0) : -1);
    r.devices.push_back(std::move(d));
  }
  host_backend h(r.host_opts);
  r.host_gran = h.granularity({});
  r.host_mem = h.mem_info();
  r.host_caps = h.capabilities();
  return r;
}

std::vector<const char*> cap_names(unsigned c) {
  static const std::pair<unsigned, const char*> all[] = {
      {cap_export_posix_fd, "export_posix_fd"}, {cap_export_fabric, "export_fabric"},
      {cap_compression, "compression"},         {cap_peer_access, "peer_access"},
      {cap_async_fences, "async_fences"},       {cap_host_access, "host_access"},
  };
  std::vector<const char*> out;
  for (auto& [bit, name] : all)
    if (c & bit) out.push_back(name);
  return out;
}

// ---- text --------------------------------------------------------------------------------------

std::string size_str(std::size_t v) {
  char buf[64];
  constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;
  if (v >= GiB && v % GiB == 0) std::snprintf(buf, sizeof buf, "%zu GiB", v / GiB);
  else if (v >= GiB) std::snprintf(buf, sizeof buf, "%.2f GiB (%zu bytes)", double(v) / double(GiB), v);
  else if (v >= MiB && v % MiB == 0) std::snprintf(buf, sizeof buf, "%zu MiB", v / MiB);
  else if (v >= 1024 && v % 1024 == 0) std::snprintf(buf, sizeof buf, "%zu KiB", v / 1024);
  else std::snprintf(buf, sizeof buf, "%zu bytes", v);
  return buf;
}

const char* yes_no(int f) { return f < 0 ? "unknown" : (f ? "yes" : "no"); }

void print_text(const report& r) {
  if (r.driver_version > 0)
    std::printf("CUDA driver: %d.%d (%d)\n", r.driver_version / 1000, (r.driver_version % 1000) / 10,
                r.driver_version);
  if (r.devices.empty()) std::printf("%s\n", r.message.c_str());
  for (const device_report& d : r.devices) {
    std::printf("CUDA device %d: %s\n", d.index, d.name.empty() ? "(unknown name)" : d.name.c_str());
    if (!d.usable) std::printf("  not usable by vmmalloc: %s\n", d.message.c_str());
    if (d.mem.ok())
      std::printf("  total memory:          %s (%s free)\n", size_str(d.mem.value.total).c_str(),
                  size_str(d.mem.value.free).c_str());
    else
      std::printf("  total memory:          n/a (%s)\n", d.mem.st.name);
    std::printf("  VMM:                   %s\n", yes_no(d.vmm));
    std::printf("  export POSIX fd:       %s\n", yes_no(d.posix_fd));
    std::printf("  export fabric handle:  %s\n", yes_no(d.fabric));
    std::printf("  generic compression:   %s\n", yes_no(d.compression));
    std::printf("  GPUDirect RDMA + VMM:  %s\n", yes_no(d.rdma_vmm));
    std::printf("  multicast (attribute): %s\n", yes_no(d.multicast));
    std::printf("  granularity (minimum / recommended):\n");
    for (const gran_row& g : d.gran) {
      if (g.g.ok())
        std::printf("    %-22s %s / %s\n", g.label, size_str(g.g.value.minimum).c_str(),
                    size_str(g.g.value.recommended).c_str());
      else
        std::printf("    %-22s n/a (%s)\n", g.label, g.g.st.name);
    }
  }
  if (!r.devices.empty()) {
    std::printf("peer access (row device can access column device):\n     ");
    for (const device_report& d : r.devices) std::printf(" %7d", d.index);
    std::printf("\n");
    for (const device_report& d : r.devices) {
      std::printf("  %3d", d.index);
      for (int p : d.peer) std::printf(" %7s", yes_no(p));
      std::printf("\n");
    }
  }
  if (!r.available) {
    if (!r.devices.empty()) std::printf("device 0 not usable: %s\n", r.message.c_str());
    std::printf("host backend (simulated devices; memfd + mmap):\n");
    if (r.host_gran.ok())
      std::printf("  granularity:           %s / %s\n", size_str(r.host_gran.value.minimum).c_str(),
                  size_str(r.host_gran.value.recommended).c_str());
    else
      std::printf("  granularity:           n/a (%s)\n", r.host_gran.st.name);
    std::printf("  simulated devices:     %d\n", r.host_opts.device_count);
    std::printf("  physical limit:        %s\n",
                r.host_mem.ok() ? size_str(r.host_mem.value.total).c_str() : "n/a");
    std::printf("  capabilities:         ");
    for (const char* c : cap_names(r.host_caps)) std::printf(" %s", c);
    std::printf("\n");
  }
}

// ---- JSON --------------------------------------------------------------------------------------
// ordered_json: keys in the order the text report uses (nlohmann's default sorts them).

using ojson = nlohmann::ordered_json;

ojson jflag(int f) { return f < 0 ? ojson(nullptr) : ojson(f != 0); }

ojson jgran(const result<granularity_info>& g) {
  if (!g.ok()) return {{"error", g.st.name}};
  return {{"minimum", g.value.minimum}, {"recommended", g.value.recommended}};
}

void print_json(const report& r) {
  ojson devices = ojson::array();
  for (const device_report& d : r.devices) {
    ojson o;
    o["index"] = d.index;
    o["name"] = d.name;
    o["usable"] = d.usable;
    o["message"] = d.message;
    if (d.mem.ok()) o["memory"] = {{"total", d.mem.value.total}, {"free", d.mem.value.free}};
    else o["memory"] = {{"error", d.mem.st.name}};
    o["vmm"] = jflag(d.vmm);
    o["posix_fd"] = jflag(d.posix_fd);
    o["fabric"] = jflag(d.fabric);
    o["generic_compression"] = jflag(d.compression);
    o["gpu_direct_rdma_with_vmm"] = jflag(d.rdma_vmm);
    o["multicast"] = jflag(d.multicast);
    ojson gran = ojson::object();
    for (const gran_row& g : d.gran) gran[g.key] = jgran(g.g);
    o["granularity"] = std::move(gran);
    ojson peers = ojson::array();
    for (int p : d.peer) peers.push_back(jflag(p));
    o["peer_access"] = std::move(peers);
    devices.push_back(std::move(o));
  }
  ojson caps = ojson::array();
  for (const char* c : cap_names(r.host_caps)) caps.push_back(c);
  ojson out;
  out["cuda"] = {{"available", r.available},
                 {"message", r.message},
                 {"driver_version", r.driver_version},
                 {"devices", std::move(devices)}};
  out["host_backend"] = {{"granularity", jgran(r.host_gran)},
                         {"simulated_devices", r.host_opts.device_count},
                         {"physical_limit", r.host_mem.ok() ? ojson(r.host_mem.value.total) : ojson(nullptr)},
                         {"capabilities", std::move(caps)}};
  // Driver messages are not guaranteed UTF-8: replace invalid bytes rather than throw.
  std::puts(out.dump(-1, ' ', false, ojson::error_handler_t::replace).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  CLI::App app{"What this machine offers vmmalloc: per CUDA device its VMM attributes, granularities and peer "
               "access; without a usable driver, the host backend. Always exits 0 once the options parse.",
               "vmm-info"};
  app.add_flag("--json", json, "print the same facts as one JSON object");
  vmm::tools::parse_or_exit(app, argc, argv);
  const report r = collect();
  if (json) print_json(r);
  else print_text(r);
  return 0;
}
