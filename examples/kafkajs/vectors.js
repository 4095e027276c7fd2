// Checks contract.js against the contract's test vectors (docs/contract.md §6, §7.1), no broker needed:
//   node vectors.js ../../tests/data/contract
// Prints one JSON line; exit 0 when every case matches (relative error ≤ 1e-5), else 1.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const c = require('./contract');

function relErr(got, want) {
  return Math.abs(got - want) / Math.max(Math.abs(want), 1e-12);
}

function main(dir) {
  const spec = JSON.parse(fs.readFileSync(path.join(dir, 'vectors.json'), 'utf8'));
  const tensors = c.parseSafetensors(fs.readFileSync(path.join(dir, 'vectors.safetensors'))).tensors;
  const alpha = tensors.alpha.values[0];
  const slots = [...Array(spec.slots).keys()];
  let maxRelErr = 0;
  let keptOk = true;
  const cases = [...spec.cases, ...(spec.revive_cases || [])];
  for (const cs of cases) {
    const m = c.masks(tensors, cs.query_embedding, cs.last_step_loss, cs.last_step_entropy, slots);
    m.forEach((v, i) => (maxRelErr = Math.max(maxRelErr, relErr(v, cs.expected_mask[i]))));
    const cm = cs.index_candidates.map((s) => m[s]);
    const keep = c.keepFlags(cm, c.SERVING_DEFAULTS);
    const kept = cs.index_candidates.filter((_, i) => keep[i]);
    keptOk = keptOk && JSON.stringify(kept) === JSON.stringify(cs.expected_kept);
    // Revival (§6 step 3b) keeps `revived` too, in index order: the event's candidates.
    const served = cs.index_candidates.filter((s, i) => keep[i] || (cs.revived || []).includes(s));
    if (cs.expected_candidates) keptOk = keptOk && JSON.stringify(served) === JSON.stringify(cs.expected_candidates);
    const pos = served.map((s) => cs.index_candidates.indexOf(s));
    const z = c.logits(pos.map((p) => cs.index_scores[p]), pos.map((p) => cm[p]), alpha, cs.temperature);
    const lp = c.plackettLuceLogprob(z, cs.selected.map((s) => served.indexOf(s)));
    maxRelErr = Math.max(maxRelErr, relErr(lp, cs.expected_logprob));
  }
  // §7.1: the delta applied to its base; the result's full-snapshot bytes must hash to state_sha256.
  const delta = JSON.parse(fs.readFileSync(path.join(dir, 'delta.json'), 'utf8'));
  const baseBlob = fs.readFileSync(path.join(dir, 'delta_base.safetensors'));
  const deltaBlob = fs.readFileSync(path.join(dir, 'delta.safetensors'));
  const man = delta.manifest;
  const base = c.verifyBlob(baseBlob, { ...man, sha256: man.base_sha256, size: baseBlob.length });
  const baseRoundTrip = c.fullSnapshotBytes(base).equals(baseBlob);
  if (deltaBlob.length !== man.size || c.sha256Hex(deltaBlob) !== man.sha256) throw new Error('delta blob');
  const state = c.applyDelta(base, deltaBlob, man.base_sha256, man.arch);
  const stateOk = c.sha256Hex(c.fullSnapshotBytes(state)) === man.state_sha256;
  const ok = maxRelErr <= 1e-5 && keptOk && stateOk && baseRoundTrip;
  console.log(JSON.stringify({ ok, cases: cases.length, max_rel_err: maxRelErr, kept_ok: keptOk, state_sha256_ok: stateOk,
    full_snapshot_bytes_ok: baseRoundTrip }));
  return ok ? 0 : 1;
}

process.exitCode = main(process.argv[2] || path.join(__dirname, '..', '..', 'tests', 'data', 'contract'));
