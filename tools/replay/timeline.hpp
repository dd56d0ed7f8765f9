// SPDX-License-Identifier: Apache-2.0
// Memory over the event index, cut down to a few samples for plotting (vmm-replay --samples,
// vmm-plot). A timeline is made from per-event values (one value after every event of a trace)
// by keeping at most max_samples evenly spaced samples, each the MAXIMUM of its series over the
// events since the previous sample (so a short spike between samples is not lost), plus one sample
// at the first event where each series reaches its peak: the plotted peak is the true peak, at its
// true event.
//
// Cost: O(events) time, O(samples) memory beyond the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace vmm::replay {

struct series_peak {
  std::size_t event = 0;   // 0-based index of the first event after which the series is at its peak
  std::uint64_t bytes = 0;
};

struct timeline {
  std::size_t events = 0;            // events in the trace
  std::vector<std::size_t> event;    // per sample: index of the last event it covers, increasing
  std::vector<std::uint64_t> live;   // requested bytes live
  std::vector<std::uint64_t> mapped;    // physical bytes held; empty = not observable
  std::vector<std::uint64_t> reserved;  // virtual address space held; empty = not observable
  series_peak peak_live;
  std::optional<series_peak> peak_mapped, peak_reserved;
};

// live is required (one value per event); mapped/reserved are either empty or as long as live.
// max_samples >= 1. The result holds at most max_samples + 3 samples, the last one at the last
// event. Throws std::invalid_argument on mismatched lengths or max_samples == 0.
timeline make_timeline(std::span<const std::uint64_t> live, std::span<const std::uint64_t> mapped,
                       std::span<const std::uint64_t> reserved, std::size_t max_samples);

}  // namespace vmm::replay
