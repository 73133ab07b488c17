#!/usr/bin/perl

# Conversations with an image (llama-server with --mmproj).
#
# The re-prime renders a turn through /apply-template, which writes an
# image as a text marker: evaluated as text it cut the slot at the image
# before every save (39 of 2,992 tokens cached on return).  A turn with
# media is saved as the slot holds it, and says so.
#
# A build that cannot serialise an image chunk answers the save 501
# ("Cannot serialize media chunk in server tokens"): the conversation is
# never answered 5xx, the refusal is said once per session at info (no
# error per swap), counted, and such a session stays in its slot while
# another can go.  The fake backend plays that build; the real one (with
# the rig's random-weight projector, when the rig has it) the rest.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use MIME::Base64;
use Test::More;

# a 1x1 PNG is enough for the fake; the real backend gets the rig's image
our $png = 'data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAf'
        . 'FcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==';

sub image_msgs {
    my ($id, $n) = @_;
    my @m = ({ role => 'user',
               content => [ { type => 'text', text => "$id: what is this?" },
                            { type => 'image_url',
                              image_url => { url => $png } } ] });
    for my $i (1 .. $n) {
        push @m, { role => 'assistant', content => "answer $i" },
                 { role => 'user', content => "$id question $i" };
    }
    return \@m;
}

sub text_msgs {
    my ($id, $n) = @_;
    my @m = ({ role => 'user', content => "$id: hello" });
    for my $i (1 .. $n) {
        push @m, { role => 'assistant', content => "answer $i" },
                 { role => 'user', content => "$id question $i" };
    }
    return \@m;
}

sub chat {
    my ($t, $id, $msgs) = @_;
    return $t->post('/v1/chat/completions',
                    { messages => $msgs, max_tokens => 2 },
                    headers => { 'X-Session-Id' => $id });
}

sub actions {
    my ($t, $since) = @_;
    my @c = @{ $t->fake_calls };
    return join ' ', map {
        $_->{path} =~ m{^/slots/(\d+)$}
            ? (($_->{query} =~ /action=(\w+)/)[0] . ":" . ($_->{path} =~ m{(\d+)$})[0])
            : $_->{path} eq '/apply-template' ? 'template' : ()
    } @c[$since .. $#c];
}

# 1. a build that refuses to save an image: one slot, turns taking turns

{
    my $t = LlamaTest->new(workers => 2);
    $t->fake(np => 1, script => { media => 1 });
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        location => 'add_header X-S-Action $llama_session_action always;',
        extra => 'location = /metrics { llama_session_metrics; }'));

    for my $round (1 .. 3) {
        my $r = chat($t, 'pic', image_msgs('pic', $round - 1));
        is($r->{status}, 200, "round $round: the image conversation is "
                              . 'answered');
        is($r->{headers}{'x-s-action'}, 'fresh',
           "round $round: from its history (no file)");
        $r = chat($t, 'txt', text_msgs('txt', $round - 1));
        is($r->{status}, 200, "round $round: a text conversation takes "
                              . 'the slot');
        is($r->{headers}{'x-s-action'}, $round == 1 ? 'fresh' : 'restore',
           "round $round: the text conversation "
           . ($round == 1 ? 'starts' : 'is restored'));
    }

    my @said = $t->log_lines(qr/cannot save slot 0: session "pic-[0-9a-f]+" holds media/);
    is(scalar @said, 1, 'the refusal is said once for the session');
    like($said[0] // '', qr/\[info\]/, 'at info');
    ok(!$t->log_lines(qr/\[(?:error|crit|alert|emerg)\]/),
       'no error on the way');
    ok(!$t->log_lines(qr/\[warn\].*"pic-/), 'nor a warning of the session');
    like($t->get('/metrics')->{content},
         qr/^nginx_llama_session_media_unsaved_total\{zone="llama"[^}]*\} 3$/m,
         'the three refused saves are counted');
    $t->stop;
}

# 2. two slots: once the backend refused, the image conversation is the
# last to leave its slot; its turns are saved without a re-prime

{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 2, script => { media => 1 });
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m slots=2 '
                . 'store=%%SLOTS%%;',
        location => 'add_header X-S-Action $llama_session_action always;'));

    is(chat($t, 'pic', image_msgs('pic', 0))->{status}, 200, 'pic');
    is(chat($t, 'a', text_msgs('a', 0))->{status}, 200, 'a');
    # b: pic is the least recently used, it leaves (the first refusal)
    my $n = scalar @{ $t->fake_calls };
    is(chat($t, 'b', text_msgs('b', 0))->{status}, 200, 'b takes a slot');
    like(actions($t, $n), qr/^save:\d\b/, 'pic was asked to leave: '
                                          . actions($t, $n));
    ok(!(actions($t, $n) =~ /template/),
       'its image turn was saved without a render');
    ok($t->log_lines(qr/the last turn of "pic-[0-9a-f]+" holds an image, audio or a file: its slot is saved as it is/),
       'and the log says why');

    # pic comes back (a) leaves; then a again: now pic is the least
    # recently used, but b goes
    my $r = chat($t, 'pic', image_msgs('pic', 1));
    is($r->{status}, 200, 'pic returns');
    is(chat($t, 'b', text_msgs('b', 1))->{status}, 200, 'b, a hit');
    $n = scalar @{ $t->fake_calls };
    is(chat($t, 'a', text_msgs('a', 1))->{status}, 200, 'a returns');
    my $slot_of_b;
    like(actions($t, $n), qr/\bsave:\d/, 'a slot was saved for a: '
                                         . actions($t, $n));
    $r = chat($t, 'pic', image_msgs('pic', 2));
    is($r->{headers}{'x-s-action'}, 'hit',
       'pic stayed in its slot though it was the least recently used');
    ok(!$t->log_lines(qr/\[(?:error|crit|alert|emerg)\]/),
       'no error on the way');
    $t->stop;
}

# 3. the real llama-server with the rig's projector (an image is 16
# tokens): an image conversation, then a long document, returns with its
# cache, as a text conversation on the same backend does (full attention:
# both saved as their slots hold them; the re-prime's skip of a turn with
# media is in t/36-reprime-renders.t)

{
    my $mmproj = LlamaTest::rig_path('make-model.sh mmproj');
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 1, ctx => 8192, args => [ '--mmproj', $mmproj ]);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
              . 'save_idle=300ms;',
        location => 'add_header X-S-Action $llama_session_action always;'));

    local $png = 'data:image/png;base64,' . encode_base64(png(32, 32), '');
    my $doc = join ' ', map { "word$_" } 1 .. 700;

    my (@pic, @txt);
    @pic = ({ role => 'user',
              content => [ { type => 'image_url',
                             image_url => { url => $png } },
                           { type => 'text', text => "Read this: $doc" } ] });
    @txt = ({ role => 'user', content => "Another document: $doc" });

    for my $round (1 .. 3) {
        for my $c ([ 'pic', \@pic ], [ 'txt', \@txt ]) {
            my ($id, $msgs) = @$c;
            my $n = () = $t->log_lines(qr/idle save of "$id-/);
            my $r = $t->post('/v1/chat/completions',
                             { messages => $msgs, max_tokens => 4,
                               temperature => 0 },
                             headers => { 'X-Session-Id' => $id });
            is($r->{status}, 200, "round $round: $id answered");
            my $tm = $r->{json}{timings} // {};
            my ($cached, $all) = ($tm->{cache_n} // 0,
                                  ($tm->{cache_n} // 0)
                                  + ($tm->{prompt_n} // 0));
            if ($round > 1) {
                is($r->{headers}{'x-s-action'}, 'restore',
                   "round $round: $id restored");
                cmp_ok($cached, '>=', 0.95 * $all,
                       "round $round: $id reuses its history: $cached of "
                       . "$all tokens cached");
            }
            my $reply = $r->{json}{choices}[0]{message}{content} // '';
            push @$msgs, { role => 'assistant', content => $reply },
                         { role => 'user', content => "question $round" };
            ok($t->wait_for(sub { $t->log_lines(qr/idle save of "$id-/)
                                  > $n }, 10),
               "round $round: $id saved while idle");
        }
    }
    ok(!$t->log_lines(qr/re-primed "|holds an image/),
       'full attention: both saved as their slots hold them');
    ok(!$t->log_lines(qr/\[(?:error|crit|alert|emerg)\]/),
       'no error on the way');
    $t->stop;
}

done_testing;

# a PNG of w x h pixels, a gradient (Compress::Zlib: core Perl)
sub png {
    my ($w, $h) = @_;
    require Compress::Zlib;
    my $chunk = sub {
        my ($type, $data) = @_;
        return pack('N', length $data) . $type . $data
             . pack('N', Compress::Zlib::crc32($type . $data));
    };
    my $raw = join '', map {
        my $y = $_;
        "\0" . join '', map { pack 'C3', $_ * 8, $y * 8, 128 } 0 .. $w - 1
    } 0 .. $h - 1;
    return "\x89PNG\r\n\x1a\n"
         . $chunk->('IHDR', pack 'NNCCCCC', $w, $h, 8, 2, 0, 0, 0)
         . $chunk->('IDAT', Compress::Zlib::compress($raw))
         . $chunk->('IEND', '');
}
