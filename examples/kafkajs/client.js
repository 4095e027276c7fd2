#!/usr/bin/env node
// A reference client of the causal-memory wire contract (docs/contract.md), in Node.js with kafkajs 2.
// It imports nothing from the Python project. It follows the model topic (the newest verified serving
// checkpoint), serves simulated queries over S random memories by the serving rule (§6) as the loaded
// manifest's `serving` says, and publishes each step's RetrievalEvent and LLMFeedback.
//
//   npm ci && node client.js --bootstrap 127.0.0.1:9092 [--prefix P] [--dim 384] [--slots 1024] [--queries 50]
//
// The last line on stdout is a JSON summary; progress goes to stderr.
'use strict';

const crypto = require('node:crypto');
const { Kafka, Partitioners, logLevel } = require('kafkajs');
const c = require('./contract');
const { ModelFollower } = require('./follower');

const K = 3; // memories read per step (the client's choice, §6)
const N_CANDIDATES = 20; // the similarity search's size
const REVIVE = 0.1; // §6 step 3b: a dropped candidate's chance back on an exploratory request

function args(argv) {
  const out = { prefix: '', policy: 'default', dim: 384, slots: 1024, queries: 20, steps: 2, timeout: 30, seed: 1 };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '');
    if (!(name in out) && name !== 'bootstrap') throw new Error(`unknown option ${argv[i]}`);
    out[name] = typeof out[name] === 'number' ? Number(argv[i + 1]) : argv[i + 1];
  }
  if (!out.bootstrap) throw new Error('--bootstrap HOST:PORT is required');
  return out;
}

function rng(seed) { // mulberry32: reproducible runs
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function unitVector(random, dim) {
  const v = Array.from({ length: dim }, () => Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random()));
  const norm = Math.hypot(...v);
  return v.map((x) => x / norm);
}

// One step under the serving rule (§6) with `policy` (null: none loaded, m = 0, α = 0) served as `serving`.
function serve(policy, serving, memories, q, loss, entropy, random) {
  const scored = memories.map((mem, slot) => [mem.reduce((a, x, i) => a + x * q[i], 0), slot]);
  scored.sort((a, b) => b[0] - a[0]);
  const found = scored.slice(0, N_CANDIDATES);
  const slots = found.map(([, s]) => s);
  const m = policy ? c.masks(policy.tensors, q, loss, entropy, slots) : slots.map(() => 0);
  const alpha = policy ? policy.tensors.alpha.values[0] : 0;
  let keep = c.keepFlags(m, serving);
  const explore = serving.explore_rate > 0 && random() < serving.explore_rate;
  if (explore) keep = keep.map((k) => k || random() < REVIVE); // drawn before, and apart from, the order's draw
  const idx = slots.map((_, i) => i).filter((i) => keep[i]); // kept (and revived) in index order
  const temperature = explore ? serving.explore_temperature : serving.temperature;
  const dropped = slots.filter((_, i) => !keep[i]);
  if (idx.length === 0) { // the drop left nothing: another retriever serves (not a policy decision)
    return { candidates: [], scores: [], selected: [], temperature, logprob: 0, fallback: true, dropped };
  }
  const scores = idx.map((i) => found[i][0]);
  const z = c.logits(scores, idx.map((i) => m[i]), alpha, temperature);
  const order = c.samplePlackettLuce(z, K, random);
  return {
    candidates: idx.map((i) => slots[i]),
    scores,
    selected: order.map((p) => slots[idx[p]]),
    temperature,
    logprob: Math.min(c.plackettLuceLogprob(z, order), 0),
    fallback: false,
    dropped,
  };
}

async function main() {
  const o = args(process.argv.slice(2));
  const log = (line) => process.stderr.write(`${line}\n`);
  const runId = crypto.randomBytes(6).toString('hex');
  const kafka = new Kafka({ clientId: `causalmem-kafkajs-${runId}`, brokers: [o.bootstrap], logLevel: logLevel.WARN });
  const follower = new ModelFollower({
    kafka,
    topic: `${o.prefix}policy-checkpoints`,
    policy: o.policy,
    group: `${o.prefix}causalmem-client-${runId}`,
    log,
  });
  // Topics are created by `causalmem init-topics`, never by a client; keys go to Java's murmur2 partition.
  const producer = kafka.producer({ allowAutoTopicCreation: false, createPartitioner: Partitioners.DefaultPartitioner });
  const summary = { run_id: runId, events: 0, feedback: 0, temperatures: {}, fallbacks: 0 };
  try {
    // A topic that does not exist (no `causalmem init-topics` yet) is an error here, never created.
    await follower.start();
    await producer.connect();
    const policy = await follower.loaded(o.timeout * 1000);
    const first = policy.manifest;
    log(`serving policy ${o.policy} v${first.version} (${first.reason}), serving ${JSON.stringify(c.servingOf(first))}`);
    const random = rng(o.seed);
    const memories = Array.from({ length: o.slots }, () => unitVector(random, o.dim));
    for (let qn = 0; qn < o.queries; qn++) {
      const queryId = `${runId}:q${qn}`;
      let loss = 0; // step 0: no previous step, so no loss and no entropy
      let entropy = 0;
      for (let step = 0; step < o.steps; step++) {
        const served = follower.current; // a newer verified version may have been swapped in meanwhile
        const serving = c.servingOf(served.manifest);
        const q = unitVector(random, o.dim);
        const s = serve(served, serving, memories, q, loss, entropy, random);
        const ts = Date.now() / 1000;
        const event = {
          schema: 'retrieval_event/v1',
          event_id: `${queryId}/${step}/event`,
          query_id: queryId,
          step,
          ts,
          policy: o.policy,
          policy_version: served.manifest.version,
          features: { query_embedding: q, last_step_loss: loss, last_step_entropy: entropy },
          candidates: s.candidates,
          scores: s.scores,
          selected: s.selected,
          temperature: s.temperature,
          logprob: s.logprob,
          fallback: s.fallback,
        };
        // The LLM's answer NLL with and without the memories (simulated); feedback has its own event_id.
        const nllWithout = 1.5 + random();
        const nllWith = Math.max(0, nllWithout - 0.5 + random());
        const feedback = {
          schema: 'llm_feedback/v1',
          event_id: `${queryId}/${step}/feedback`,
          query_id: queryId,
          step,
          ts: ts + 0.5,
          nll_with: nllWith,
          nll_without: nllWithout,
        };
        await producer.send({ topic: `${o.prefix}retrieval-events`, messages: [{ key: queryId, value: JSON.stringify(event) }] });
        await producer.send({ topic: `${o.prefix}llm-feedback`, messages: [{ key: queryId, value: JSON.stringify(feedback) }] });
        summary.events += 1;
        summary.feedback += 1;
        summary.fallbacks += s.fallback ? 1 : 0;
        summary.temperatures[s.temperature] = (summary.temperatures[s.temperature] || 0) + 1;
        loss = nllWith; // the next step's features: this step's answer NLL and its mean token entropy
        entropy = 1.5 + 0.5 * random();
      }
    }
    const m = follower.current.manifest;
    Object.assign(summary, {
      policy: m.policy,
      version: m.version,
      first_version: first.version,
      reason: m.reason,
      sha256: m.sha256,
      sha256_ok: true, // follower.current only ever holds a verified checkpoint
      deltas_loaded: follower.deltasLoaded,
      serving: c.servingOf(m),
    });
  } finally {
    await producer.disconnect().catch((err) => log(`producer: ${err.message}`));
    await follower.stop().catch((err) => log(`follower: ${err.message}`));
  }
  process.stdout.write(`${JSON.stringify(summary)}\n`);
}

main().catch((err) => {
  process.stderr.write(`error: ${err.message}\n`);
  process.exitCode = 1;
});
