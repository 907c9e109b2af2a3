// data/filler.h: English filler text generated from a small grammar (no corpus is shipped, so there is no
// licence to track). Sentences are grammatical past-tense English with subject/verb agreement and a/an chosen
// by the next word; they never contain digits or the words the recall task uses for facts and queries
// ("code", "pin", "number", "Question", "Answer"), so a recall pattern can never appear by chance.
#ifndef SDM_DATA_FILLER_H
#define SDM_DATA_FILLER_H

#include <ctype.h>
#include <string.h>

#include "core/rng.h"
#include "data/jsonl.h"

#define FILLER_COUNT(a) (sizeof(a) / sizeof((a)[0]))

typedef struct { const char *one, *many; } FillerNoun;

static const FillerNoun filler_people[] = {
    {"farmer", "farmers"}, {"miller", "millers"}, {"teacher", "teachers"}, {"child", "children"},
    {"sailor", "sailors"}, {"merchant", "merchants"}, {"doctor", "doctors"}, {"baker", "bakers"},
    {"shepherd", "shepherds"}, {"soldier", "soldiers"}, {"painter", "painters"}, {"fisherman", "fishermen"},
    {"king", "kings"}, {"queen", "queens"}, {"traveller", "travellers"}, {"student", "students"},
    {"woman", "women"}, {"man", "men"}, {"dog", "dogs"}, {"horse", "horses"}, {"fox", "foxes"},
    {"bird", "birds"}, {"cat", "cats"}, {"neighbour", "neighbours"}, {"stranger", "strangers"},
    {"poet", "poets"}, {"judge", "judges"}, {"owl", "owls"}, {"innkeeper", "innkeepers"}, {"weaver", "weavers"},
};
static const FillerNoun filler_things[] = {
    {"river", "rivers"}, {"house", "houses"}, {"bridge", "bridges"}, {"garden", "gardens"},
    {"letter", "letters"}, {"book", "books"}, {"basket", "baskets"}, {"road", "roads"}, {"field", "fields"},
    {"window", "windows"}, {"lamp", "lamps"}, {"boat", "boats"}, {"village", "villages"},
    {"forest", "forests"}, {"mountain", "mountains"}, {"market", "markets"}, {"table", "tables"},
    {"song", "songs"}, {"coat", "coats"}, {"wall", "walls"}, {"gate", "gates"}, {"bell", "bells"},
    {"story", "stories"}, {"map", "maps"}, {"tower", "towers"}, {"well", "wells"}, {"orchard", "orchards"},
    {"harbour", "harbours"}, {"path", "paths"}, {"cart", "carts"}, {"candle", "candles"}, {"apple", "apples"},
    {"island", "islands"}, {"chair", "chairs"}, {"umbrella", "umbrellas"}, {"hill", "hills"},
};
static const char *filler_names[] = {"Anna", "Tom", "Maria", "Peter", "Lucy", "Oliver", "Emma", "Jack",
                                     "Clara", "Henry", "Rosa", "Samuel", "Ida", "Felix", "Nora", "Hugo"};
static const char *filler_adjectives[] = {
    "old", "young", "quiet", "small", "large", "bright", "dark", "green", "red", "tired", "careful", "clever",
    "gentle", "brave", "strange", "heavy", "narrow", "wide", "cold", "warm", "ancient", "busy", "silent",
    "proud", "happy", "patient", "wild", "golden", "empty", "distant", "simple", "rough", "soft", "little",
    "honest", "curious", "hungry", "broken", "wooden", "early", "open", "lonely"};
static const char *filler_transitive[] = {
    "carried", "found", "watched", "painted", "followed", "opened", "built", "crossed", "visited",
    "remembered", "mended", "sold", "bought", "described", "noticed", "cleaned", "left", "helped", "called",
    "praised", "guarded", "reached", "lost", "chose", "forgot", "admired", "pulled", "hid", "showed", "kept"};
static const char *filler_intransitive[] = {
    "slept", "laughed", "waited", "sang", "walked", "rested", "listened", "worked", "hurried", "smiled",
    "wandered", "arrived", "returned", "stayed", "danced", "whispered", "waved", "paused"};
static const char *filler_adverbs[] = {"slowly", "quietly", "early", "late", "carefully", "again", "often",
                                       "suddenly", "happily", "alone", "together", "at last", "for a while",
                                       "without a word", "all day"};
static const char *filler_prepositions[] = {"near", "behind", "beside", "across", "under", "over", "inside",
                                            "beyond", "along", "towards", "past", "through", "around", "by"};
static const char *filler_openers[] = {"In the morning", "After the storm", "Before dawn", "Later that day",
                                       "During the winter", "On the next day", "At night", "Long ago",
                                       "In the spring", "By evening", "Once", "That summer"};
static const char *filler_thinking[] = {"said", "thought", "knew", "heard", "believed", "wrote"};
static const char *filler_linkers[] = {"because", "while", "before", "after", "although"};

#define FILLER_PICK(rng, list) ((list)[rng_below((rng), (uint32_t)FILLER_COUNT(list))])

static inline void filler_word(ByteBuf *out, const char *w) {
    if (out->len > 0 && out->data[out->len - 1] != ' ' && out->data[out->len - 1] != '\n') bytebuf_append(out, " ", 1);
    bytebuf_append(out, w, strlen(w));
}

static inline void filler_article(ByteBuf *out, const char *next) {
    filler_word(out, strchr("aeiou", next[0]) ? "an" : "a");
}

// A noun phrase; *plural says whether it was plural (for the verb "was"/"were").
static inline void filler_noun_phrase(Rng *r, ByteBuf *out, int *plural) {
    uint32_t kind = rng_below(r, 10);
    *plural = 0;
    if (kind < 2) { filler_word(out, FILLER_PICK(r, filler_names)); return; }
    const FillerNoun *n = kind < 6 ? &FILLER_PICK(r, filler_people) : &FILLER_PICK(r, filler_things);
    *plural = rng_below(r, 4) == 0;
    const char *adj = rng_below(r, 2) ? FILLER_PICK(r, filler_adjectives) : NULL;
    const char *first = adj ? adj : (*plural ? n->many : n->one);
    if (*plural) filler_word(out, rng_below(r, 2) ? "the" : "some");
    else if (rng_below(r, 2)) filler_word(out, "the");
    else filler_article(out, first);
    if (adj) filler_word(out, adj);
    filler_word(out, *plural ? n->many : n->one);
}

static inline void filler_object(Rng *r, ByteBuf *out) {
    int plural;
    filler_noun_phrase(r, out, &plural);
}

static inline void filler_place(Rng *r, ByteBuf *out) {
    filler_word(out, FILLER_PICK(r, filler_prepositions));
    filler_object(r, out);
}

static inline void filler_clause(Rng *r, ByteBuf *out) {
    int plural;
    filler_noun_phrase(r, out, &plural);
    switch (rng_below(r, 5)) {
    case 0:
        filler_word(out, FILLER_PICK(r, filler_intransitive));
        filler_word(out, FILLER_PICK(r, filler_adverbs));
        break;
    case 1: filler_word(out, FILLER_PICK(r, filler_intransitive)); filler_place(r, out); break;
    case 2: filler_word(out, plural ? "were" : "was"); filler_word(out, FILLER_PICK(r, filler_adjectives)); break;
    default:
        filler_word(out, FILLER_PICK(r, filler_transitive));
        filler_object(r, out);
        if (rng_below(r, 3) == 0) filler_place(r, out);
    }
}

static inline void filler_capitalize(ByteBuf *out, size_t at) {
    while (at < out->len && out->data[at] == ' ') at++;
    if (at < out->len) out->data[at] = (uint8_t)toupper(out->data[at]);
}

// Append one sentence (with a leading space unless at the start of a line).
static inline void filler_sentence(Rng *r, ByteBuf *out) {
    size_t start = out->len;
    switch (rng_below(r, 6)) {
    case 0:
        filler_word(out, FILLER_PICK(r, filler_openers));
        bytebuf_append(out, ",", 1);
        filler_clause(r, out);
        break;
    case 1:
        filler_clause(r, out);
        filler_word(out, FILLER_PICK(r, filler_linkers));
        filler_clause(r, out);
        break;
    case 2: {
        int plural;
        filler_noun_phrase(r, out, &plural);
        filler_word(out, FILLER_PICK(r, filler_thinking));
        filler_word(out, "that");
        filler_clause(r, out);
        break;
    }
    case 3: {
        const char *adj = FILLER_PICK(r, filler_adjectives);
        filler_word(out, "there was");
        filler_article(out, adj);
        filler_word(out, adj);
        filler_word(out, FILLER_PICK(r, filler_things).one);
        filler_place(r, out);
        break;
    }
    default: filler_clause(r, out);
    }
    filler_capitalize(out, start);
    bytebuf_append(out, ".", 1);
}

#endif
