// Layout: Megatron Core's RankGenerator arithmetic for the dense and expert
// views, and the validation rules of ARCHITECTURE.md §3.
#include "comm/layout.h"

#include <algorithm>
#include <sstream>

#include "kernels/check.h"

namespace origami::comm {

namespace {

constexpr std::array<Axis, kNumAxes> kAxesByName = {Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp};

// Megatron appends omitted axes in its name_to_size order (tp, pp, dp, ep,
// cp). They have size 1, so where they go changes no rank; we copy it anyway.
constexpr std::array<Axis, kNumAxes> kAppendOrder = {Axis::tp, Axis::pp, Axis::dp, Axis::ep, Axis::cp};

std::vector<std::string> split_dash(std::string_view s) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dash = s.find('-', start);
    parts.emplace_back(s.substr(start, dash == std::string_view::npos ? std::string_view::npos : dash - start));
    if (dash == std::string_view::npos) break;
    start = dash + 1;
  }
  return parts;
}

bool parse_axis(std::string_view name, Axis* out) {
  for (Axis a : kAxesByName)
    if (axis_name(a) == name) {
      *out = a;
      return true;
    }
  return false;
}

}  // namespace

std::string format_group(const RankGroup& g) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < g.size(); ++i) os << (i ? "," : "") << g[i];
  os << ']';
  return os.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(ranks[i]);
    if (j > i) s += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

std::string_view axis_name(Axis a) {
  switch (a) {
    case Axis::tp: return "tp";
    case Axis::cp: return "cp";
    case Axis::ep: return "ep";
    case Axis::dp: return "dp";
    case Axis::pp: return "pp";
  }
  return "?";
}

std::string_view group_name(GroupKind k) {
  switch (k) {
    case GroupKind::tp: return "tp";
    case GroupKind::cp: return "cp";
    case GroupKind::dp: return "dp";
    case GroupKind::dp_cp: return "dp-cp";
    case GroupKind::tp_cp: return "tp-cp";
    case GroupKind::tp_dp_cp: return "tp-dp-cp";
    case GroupKind::pp: return "pp";
    case GroupKind::tp_pp: return "tp-pp";
    case GroupKind::embedding: return "embedding";
    case GroupKind::ep: return "ep";
    case GroupKind::etp: return "etp";
    case GroupKind::edp: return "edp";
    case GroupKind::tp_ep: return "tp-ep";
    case GroupKind::tp_ep_pp: return "tp-ep-pp";
  }
  return "?";
}

View group_view(GroupKind k) {
  return static_cast<int>(k) < static_cast<int>(GroupKind::ep) ? View::dense : View::expert;
}

Layout::Layout(int64_t world, const LayoutOptions& options) : world_(world), opt_(options) {
  const LayoutOptions& o = opt_;
  if (world < 1) ORIGAMI_USER_ERROR("world size ", world, " must be at least 1");
  const struct {
    const char* name;
    int64_t size;
  } given[] = {{"tp", o.tp}, {"cp", o.cp}, {"pp", o.pp}, {"ep", o.ep}, {"etp", o.etp}};
  for (const auto& g : given)
    if (g.size < 1) ORIGAMI_USER_ERROR("parallel size ", g.name, " = ", g.size, " must be at least 1");

  const int64_t dense_cut = o.tp * o.cp * o.pp, expert_cut = o.etp * o.ep * o.pp;
  if (world % dense_cut != 0)
    ORIGAMI_USER_ERROR("world size ", world, " is not divisible by TP·CP·PP = ", o.tp, "·", o.cp, "·", o.pp, " = ",
                       dense_cut);
  if (world % expert_cut != 0)
    ORIGAMI_USER_ERROR("world size ", world, " is not divisible by ETP·EP·PP = ", o.etp, "·", o.ep, "·", o.pp, " = ",
                       expert_cut);
  dp_ = world / dense_cut;
  edp_ = world / expert_cut;
  if (o.num_experts < 0) ORIGAMI_USER_ERROR("num_experts = ", o.num_experts, " must be at least 0");
  if (o.num_experts > 0 && o.num_experts % o.ep != 0)
    ORIGAMI_USER_ERROR("num_experts = ", o.num_experts, " is not divisible by EP = ", o.ep);

  // Sizes by axis in both generators.
  auto idx = [](Axis a) { return static_cast<size_t>(a); };
  dense_size_[idx(Axis::tp)] = o.tp;
  dense_size_[idx(Axis::cp)] = o.cp;
  dense_size_[idx(Axis::ep)] = 1;
  dense_size_[idx(Axis::dp)] = dp_;
  dense_size_[idx(Axis::pp)] = o.pp;
  expert_size_[idx(Axis::tp)] = o.etp;
  expert_size_[idx(Axis::cp)] = 1;
  expert_size_[idx(Axis::ep)] = o.ep;
  expert_size_[idx(Axis::dp)] = edp_;
  expert_size_[idx(Axis::pp)] = o.pp;

  // The order string: known axes, each at most once; an omitted axis must have
  // size 1 in both views.
  const std::vector<std::string> tokens = split_dash(o.order);
  std::array<bool, kNumAxes> seen{};
  int n = 0;
  for (const std::string& t : tokens) {
    Axis a;
    if (!parse_axis(t, &a))
      ORIGAMI_USER_ERROR("order \"", o.order, "\": unknown axis '", t, "' (axes are tp, cp, ep, dp, pp joined by '-')");
    if (seen[idx(a)]) ORIGAMI_USER_ERROR("order \"", o.order, "\": axis '", t, "' appears twice");
    seen[idx(a)] = true;
    axes_[n++] = a;
  }
  for (Axis a : kAppendOrder) {
    if (seen[idx(a)]) continue;
    const int64_t ds = dense_size_[idx(a)], es = expert_size_[idx(a)];
    if (ds != 1 || es != 1) {
      using detail::concat;
      const std::string why = a == Axis::tp   ? concat("TP = ", ds, ", ETP = ", es)
                              : a == Axis::dp ? concat("DP = ", ds, ", EDP = ", es)
                              : a == Axis::cp ? concat("CP = ", ds)
                              : a == Axis::ep ? concat("EP = ", es)
                                              : concat("PP = ", ds);
      ORIGAMI_USER_ERROR("order \"", o.order, "\" omits axis '", axis_name(a), "' but ", why,
                         "; only axes of size 1 may be omitted");
    }
    axes_[n++] = a;
  }

  // Strides: fastest axis first.
  int64_t ds = 1, es = 1;
  for (Axis a : axes_) {
    dense_stride_[idx(a)] = ds;
    expert_stride_[idx(a)] = es;
    ds *= dense_size_[idx(a)];
    es *= expert_size_[idx(a)];
  }

  // Megatron: unless pp is last, the expert DP must match the dense DP (the
  // pipeline stages would otherwise interleave differently in the two views).
  if (o.pp > 1 && tokens.back() != "pp" && edp_ != dp_)
    ORIGAMI_USER_ERROR("order \"", o.order,
                       "\" does not end with pp, so EDP must equal DP, but EDP = W/(ETP·EP·PP) = ", world, "/(", o.etp,
                       "·", o.ep, "·", o.pp, ") = ", edp_, " and DP = W/(TP·CP·PP) = ", world, "/(", o.tp, "·", o.cp,
                       "·", o.pp, ") = ", dp_);
  // Both views must cut the model into the same pipeline stages.
  const RankGroups dense_pp = groups(View::dense, "pp"), expert_pp = groups(View::expert, "pp");
  for (size_t g = 0; g < dense_pp.size(); ++g)
    if (dense_pp[g] != expert_pp[g])
      ORIGAMI_USER_ERROR("order \"", o.order, "\" gives different pipeline groups in the dense view (TP=", o.tp,
                         ", CP=", o.cp, ", DP=", dp_, ", PP=", o.pp, ") and the expert view (ETP=", o.etp,
                         ", EP=", o.ep, ", EDP=", edp_, ", PP=", o.pp, "): dense pp group ", g, " is ",
                         format_group(dense_pp[g]), ", expert pp group ", g, " is ", format_group(expert_pp[g]));
}

std::array<bool, kNumAxes> Layout::mask_of(View view, std::string_view axes) const {
  std::array<bool, kNumAxes> mask{};
  for (const std::string& t : split_dash(axes)) {
    Axis a;
    std::string_view name = t;
    // In the expert view the tp and dp slots hold ETP and EDP.
    if (view == View::expert && name == "etp") name = "tp";
    if (view == View::expert && name == "edp") name = "dp";
    if (!parse_axis(name, &a)) ORIGAMI_USER_ERROR("group \"", axes, "\": unknown axis '", t, "'");
    if (mask[static_cast<size_t>(a)]) ORIGAMI_USER_ERROR("group \"", axes, "\": axis '", t, "' appears twice");
    mask[static_cast<size_t>(a)] = true;
  }
  return mask;
}

// generate_masked_orthogonal_rank_groups: group g's unmasked coordinates are
// g decomposed over the unmasked axes (first fastest); its members take every
// combination of the masked coordinates (first fastest). Both decompositions
// follow increasing strides, so members ascend and first ranks ascend with g.
RankGroups Layout::generate(View view, const std::array<bool, kNumAxes>& mask) const {
  const auto& size = sizes(view);
  const auto& stride = view == View::dense ? dense_stride_ : expert_stride_;
  std::vector<int64_t> m_shape, m_stride, u_shape, u_stride;
  for (Axis a : axes_) {
    const size_t i = static_cast<size_t>(a);
    (mask[i] ? m_shape : u_shape).push_back(size[i]);
    (mask[i] ? m_stride : u_stride).push_back(stride[i]);
  }
  int64_t group_size = 1;
  for (int64_t s : m_shape) group_size *= s;
  const int64_t num_groups = world_ / group_size;
  // Σ digit_i · stride_i of `index` written in the mixed radix `shape`.
  auto place = [](int64_t index, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    int64_t r = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      r += (index % shape[i]) * strides[i];
      index /= shape[i];
    }
    return r;
  };
  RankGroups out(static_cast<size_t>(num_groups));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t base = place(g, u_shape, u_stride);
    RankGroup& members = out[static_cast<size_t>(g)];
    members.reserve(static_cast<size_t>(group_size));
    for (int64_t r = 0; r < group_size; ++r) members.push_back(static_cast<int>(base + place(r, m_shape, m_stride)));
  }
  return out;
}

RankGroups Layout::groups(View view, std::string_view axes) const { return generate(view, mask_of(view, axes)); }

namespace {
// The Megatron token of each kind, in its generator.
std::string_view kind_token(GroupKind k) {
  switch (k) {
    case GroupKind::etp: return "tp";
    case GroupKind::edp: return "dp";
    case GroupKind::embedding: return "pp";
    default: return group_name(k);
  }
}
}  // namespace

RankGroups Layout::groups(GroupKind kind) const {
  RankGroups g = groups(group_view(kind), kind_token(kind));
  if (kind == GroupKind::embedding)
    for (RankGroup& r : g)
      if (r.size() > 1) r = {r.front(), r.back()};
  return g;
}

int64_t Layout::coord(View view, Axis a, int rank) const {
  const size_t i = static_cast<size_t>(a);
  const auto& size = sizes(view);
  const auto& stride = view == View::dense ? dense_stride_ : expert_stride_;
  return (rank / stride[i]) % size[i];
}

RankCoords Layout::coords(int rank) const {
  ORIGAMI_CHECK(rank >= 0 && rank < world_, "rank ", rank, " outside world of ", world_);
  RankCoords c;
  c.tp = coord(View::dense, Axis::tp, rank);
  c.cp = coord(View::dense, Axis::cp, rank);
  c.dp = coord(View::dense, Axis::dp, rank);
  c.pp = coord(View::dense, Axis::pp, rank);
  c.etp = coord(View::expert, Axis::tp, rank);
  c.ep = coord(View::expert, Axis::ep, rank);
  c.edp = coord(View::expert, Axis::dp, rank);
  return c;
}

RankGroup Layout::group_of(GroupKind kind, int rank) const {
  ORIGAMI_CHECK(rank >= 0 && rank < world_, "rank ", rank, " outside world of ", world_);
  const View view = group_view(kind);
  const std::array<bool, kNumAxes> mask = mask_of(view, kind_token(kind));
  const auto& size = sizes(view);
  const auto& stride = view == View::dense ? dense_stride_ : expert_stride_;
  // Keep this rank's unmasked coordinates; run the masked ones, first fastest.
  int64_t base = 0, group_size = 1;
  std::vector<int64_t> m_shape, m_stride;
  for (Axis a : axes_) {
    const size_t i = static_cast<size_t>(a);
    if (mask[i]) {
      m_shape.push_back(size[i]);
      m_stride.push_back(stride[i]);
      group_size *= size[i];
    } else {
      base += coord(view, a, rank) * stride[i];
    }
  }
  RankGroup members;
  for (int64_t r = 0; r < group_size; ++r) {
    int64_t idx = r, rk = base;
    for (size_t i = 0; i < m_shape.size(); ++i) {
      rk += (idx % m_shape[i]) * m_stride[i];
      idx /= m_shape[i];
    }
    members.push_back(static_cast<int>(rk));
  }
  if (kind == GroupKind::embedding && members.size() > 1) {
    members = {members.front(), members.back()};
    if (rank != members.front() && rank != members.back()) members.clear();
  }
  return members;
}

std::string describe(const Layout& l) {
  std::ostringstream os;
  for (GroupKind k : kAllGroupKinds) {
    const RankGroups gs = l.groups(k);
    os << (group_view(k) == View::dense ? "dense " : "expert ") << group_name(k) << " (" << gs.size() << " group"
       << (gs.size() == 1 ? "" : "s") << " of " << (gs.empty() ? 0 : gs.front().size()) << "):";
    for (const RankGroup& g : gs) os << ' ' << format_group(g);
    os << '\n';
  }
  return os.str();
}

}  // namespace origami::comm
