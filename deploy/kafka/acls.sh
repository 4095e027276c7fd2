#!/usr/bin/env bash
# Kafka ACLs for causal-memory-pipeline on Apache Kafka: one principal per role
# (docs/operations.md, "Security"). Run it as a super user once the topics exist, and
# again after changing the prefix, the policy or the principals; adding an ACL twice is
# harmless. With the authorizer on and allow.everyone.if.no.acl.found=false, anything
# not granted here is refused.
#
#   role       writes                                     reads
#   service    retrieval-events, llm-feedback,            policy-checkpoints, memory-lifecycle
#              memory-writes (agents propose memories),
#              memory-lifecycle (its memories by id)
#   labeler    human-labels (a "do not use" is only a     active-learning, human-labels (its own answers)
#              proposal: labelers cannot suppress)
#   operator   control (reset, rollback, cutover,         every product topic (status, evaluate)
#              suppress/unsuppress), epoch marker;
#              creates the topics (init-topics)
#   worker     outcomes, experiences, active-learning,    retrieval-events, llm-feedback, human-labels,
#              rating-pairs, dead-letter, control          outcomes, rating-pairs
#              (the drift stage's reset); its faust
#              changelog topics (<prefix>causalmem-worker-*)
#   learner    policy-checkpoints (the only writer),      experiences, control, policy-checkpoints,
#              dead-letter                                memory-lifecycle
#   evaluator  llm-feedback, dead-letter                  retrieval-events
#   writes     memory-writes-rejected, memory-lifecycle   memory-writes
#              (the write gate's adds), dead-letter
#   ui         human-labels (with a labelers file: the    retrieval-events, experiences, human-labels,
#              app's own connection writes the labels)    active-learning, policy-checkpoints, dead-letter
#              (causalmem ui: its pages and the labelers' queue; the labelers' group, and the
#              deployment's groups' offsets for its status line)
#
# Only the operators create topics. Every role may describe every product topic and read
# the epoch topic: processes check
# the topics at start, and the cluster watch reads the epoch marker (a topic a principal
# may not describe looks missing, and a missing epoch topic means a lost cluster).
#
# Usage: deploy/kafka/acls.sh [--dry-run]     (--dry-run prints the commands)
# Environment (defaults in brackets):
#   KAFKA_BOOTSTRAP [kafka:9092]   KAFKA_ADMIN_CONFIG [none]: client properties of a super user
#   KAFKA_ACLS [kafka-acls.sh, or /opt/kafka/bin/kafka-acls.sh when present]
#   CAUSALMEM_TOPIC_PREFIX [""]    CAUSALMEM_POLICY [default]
#   SERVICE_PRINCIPALS [User:causalmem-service]   LABELER_PRINCIPALS [User:labeler]
#   OPERATOR_PRINCIPALS [User:causalmem-operator] WORKER_PRINCIPAL [User:causalmem-worker]
#   LEARNER_PRINCIPAL [User:causalmem-learner]    EVALUATOR_PRINCIPAL [User:causalmem-evaluator]
#   WRITES_PRINCIPAL [User:causalmem-writes]      UI_PRINCIPAL [User:causalmem-ui]
#   (the *_PRINCIPALS lists are space-separated)
set -euo pipefail

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1

P="${CAUSALMEM_TOPIC_PREFIX:-}"
POLICY="${CAUSALMEM_POLICY:-default}"
BOOTSTRAP="${KAFKA_BOOTSTRAP:-kafka:9092}"
if [[ -z "${KAFKA_ACLS:-}" ]]; then
    KAFKA_ACLS=kafka-acls.sh
    [[ -x /opt/kafka/bin/kafka-acls.sh ]] && KAFKA_ACLS=/opt/kafka/bin/kafka-acls.sh
fi
read -r -a SERVICES <<<"${SERVICE_PRINCIPALS:-User:causalmem-service}"
read -r -a LABELERS <<<"${LABELER_PRINCIPALS:-User:labeler}"
read -r -a OPERATORS <<<"${OPERATOR_PRINCIPALS:-User:causalmem-operator}"
WORKER="${WORKER_PRINCIPAL:-User:causalmem-worker}"
LEARNER="${LEARNER_PRINCIPAL:-User:causalmem-learner}"
EVALUATOR="${EVALUATOR_PRINCIPAL:-User:causalmem-evaluator}"
WRITES="${WRITES_PRINCIPAL:-User:causalmem-writes}"
UI="${UI_PRINCIPAL:-User:causalmem-ui}"

# The product's topics (topics/names.py), under the prefix.
TOPICS=(retrieval-events llm-feedback human-labels active-learning policy-checkpoints dead-letter
    experiences outcomes rating-pairs control epoch memory-writes memory-writes-rejected memory-lifecycle)

# allow "PRINCIPAL..." topic|group literal|prefixed "NAME..." OPERATION...
# (one kafka-acls.sh call: every principal gets every operation on every name)
allow() {
    local principals=$1 kind=$2 pattern=$3 names=$4
    shift 4
    local cmd=("$KAFKA_ACLS" --bootstrap-server "$BOOTSTRAP")
    [[ -n "${KAFKA_ADMIN_CONFIG:-}" ]] && cmd+=(--command-config "$KAFKA_ADMIN_CONFIG")
    cmd+=(--add --resource-pattern-type "$pattern")
    local x
    for x in $principals; do cmd+=(--allow-principal "$x"); done
    for x in $names; do cmd+=("--$kind" "$x"); done
    for x in "$@"; do cmd+=(--operation "$x"); done
    if ((DRY_RUN)); then
        printf '%q ' "${cmd[@]}"
        printf '\n'
    else
        "${cmd[@]}" >/dev/null
    fi
}

# topics "PRINCIPAL..." "SHORT-NAME..." OPERATION...: product topics, under the prefix
topics() {
    local names=() t
    for t in $2; do names+=("$P$t"); done
    allow "$1" topic literal "${names[*]}" "${@:3}"
}

EVERYONE="${SERVICES[*]} ${LABELERS[*]} ${OPERATORS[*]} $WORKER $LEARNER $EVALUATOR $WRITES $UI"
topics "$EVERYONE" "${TOPICS[*]}" Describe
topics "$EVERYONE" epoch Read

topics "${SERVICES[*]}" "retrieval-events llm-feedback memory-writes memory-lifecycle" Write
topics "${SERVICES[*]}" "policy-checkpoints memory-lifecycle" Read
# clients that cannot assign a partition (kafkajs) follow the model topic in a group of their own
# (docs/contract.md §7, "Following without manual assignment")
allow "${SERVICES[*]}" group prefixed "${P}causalmem-client-" Read

topics "${LABELERS[*]}" human-labels Write Read
topics "${LABELERS[*]}" active-learning Read
# the shared queue's group, and --group ones named causalmem-labelers…
allow "${LABELERS[*]}" group prefixed "${P}causalmem-labelers" Read

topics "${OPERATORS[*]}" "${TOPICS[*]}" Create Read DescribeConfigs
# control: reset, rollback, cutover and "do not use" (causalmem suppress/unsuppress) are operators' decisions
topics "${OPERATORS[*]}" "control epoch" Write
# status reads the committed offsets of the deployment's groups
allow "${OPERATORS[*]}" group prefixed "${P}causalmem-" Describe

topics "$WORKER" "retrieval-events llm-feedback human-labels outcomes rating-pairs" Read
topics "$WORKER" "outcomes experiences active-learning rating-pairs dead-letter control" Write
allow "$WORKER" group literal "${P}causalmem-join ${P}causalmem-worker" Read
# faust's own topics (table changelogs, the assignor's leader topic) start with its app id
allow "$WORKER" topic prefixed "${P}causalmem-worker" All

topics "$LEARNER" "experiences control policy-checkpoints memory-lifecycle" Read
topics "$LEARNER" "policy-checkpoints dead-letter" Write
allow "$LEARNER" group literal "${P}causalmem-learner-${POLICY}" Read

# causalmem evaluator: scores retrieval events, answers with LLM feedback
topics "$EVALUATOR" retrieval-events Read
topics "$EVALUATOR" "llm-feedback dead-letter" Write
allow "$EVALUATOR" group literal "${P}causalmem-evaluator" Read

# causalmem writes: the write gate judges proposed memories; keeps the rejected ones
topics "$WRITES" memory-writes Read
topics "$WRITES" "memory-writes-rejected memory-lifecycle dead-letter" Write
allow "$WRITES" group literal "${P}causalmem-writes" Read

# causalmem ui: reads what its pages show, serves the labelers' shared queue, and (with a
# labelers file) writes their labels under its own principal
topics "$UI" "retrieval-events experiences human-labels active-learning policy-checkpoints dead-letter" Read
topics "$UI" human-labels Write
allow "$UI" group prefixed "${P}causalmem-labelers" Read
allow "$UI" group prefixed "${P}causalmem-" Describe
