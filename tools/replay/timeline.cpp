// SPDX-License-Identifier: Apache-2.0
#include "timeline.hpp"

#include <algorithm>
#include <stdexcept>

namespace vmm::replay {

namespace {
series_peak first_peak(std::span<const std::uint64_t> v) {
  series_peak p;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] > p.bytes || i == 0) p = {i, v[i]};
  return p;
}
}  // namespace

timeline make_timeline(std::span<const std::uint64_t> live, std::span<const std::uint64_t> mapped,
                       std::span<const std::uint64_t> reserved, std::size_t max_samples) {
  const std::size_t n = live.size();
  if (max_samples == 0) throw std::invalid_argument("timeline: max_samples must be at least 1");
  if ((!mapped.empty() && mapped.size() != n) || (!reserved.empty() && reserved.size() != n))
    throw std::invalid_argument("timeline: series lengths differ");
  timeline t;
  t.events = n;
  if (n == 0) return t;

  t.peak_live = first_peak(live);
  if (!mapped.empty()) t.peak_mapped = first_peak(mapped);
  if (!reserved.empty()) t.peak_reserved = first_peak(reserved);

  // Sample boundaries: the last event of each of max_samples even buckets, and each peak event.
  const std::size_t buckets = std::min(max_samples, n);
  std::vector<std::size_t> ends;
  ends.reserve(buckets + 3);
  for (std::size_t k = 1; k <= buckets; ++k) ends.push_back((k * n + buckets - 1) / buckets - 1);
  ends.push_back(t.peak_live.event);
  if (t.peak_mapped) ends.push_back(t.peak_mapped->event);
  if (t.peak_reserved) ends.push_back(t.peak_reserved->event);
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());

  auto envelope = [&](std::span<const std::uint64_t> v, std::vector<std::uint64_t>& out) {
    if (v.empty()) return;
    out.reserve(ends.size());
    std::size_t i = 0;
    for (std::size_t e : ends) {
      std::uint64_t m = v[i];
      for (; i <= e; ++i) m = std::max(m, v[i]);
      out.push_back(m);
    }
  };
  t.event = ends;
  envelope(live, t.live);
  envelope(mapped, t.mapped);
  envelope(reserved, t.reserved);
  return t;
}

}  // namespace vmm::replay
